package audit

import (
	"encoding/json"
	"strings"
	"testing"
)

var jsonSeeds = []string{
	``, ` `, `{}`, `[]`, `""`, `0`, `-0`, `01`, `1.`, `1.5e+3`, `1E9`, `-`, `true`, `tru`, `nul`, `null `,
	`{"a":1,}`, `{"a" : [1, 2, {"b": null}] }`, `[1,]`, `[,1]`, `"\u00e9\n\"\\"`, `"\u00g0"`, `"\x"`, "\"\x01\"",
	`{"a":1}{}`, `{"a":1} x`, "\"\xff\"", `{1:2}`, `[[[[]]]]`, `"` + strings.Repeat(`\\`, 3) + `"`,
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001),
}

func TestValidJSON(t *testing.T) {
	for _, s := range jsonSeeds {
		if got, want := validJSON([]byte(s)), json.Valid([]byte(s)); got != want {
			t.Errorf("validJSON(%.40q) = %v, json.Valid says %v", s, got, want)
		}
	}
}

func FuzzValidJSON(f *testing.F) {
	for _, s := range jsonSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := validJSON(b), json.Valid(b); got != want {
			t.Fatalf("validJSON(%q) = %v, json.Valid says %v", b, got, want)
		}
	})
}

func BenchmarkValidJSON(b *testing.B) {
	data := []byte(`{"argv":["go","test","./..."],"cwd":"/workspace/src","env":{"HOME":"/workspace","GOFLAGS":"-mod=mod"},"user":"agent","n":12345}`)
	b.Run("ours", func(b *testing.B) {
		for b.Loop() {
			validJSON(data)
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		for b.Loop() {
			json.Valid(data)
		}
	})
}
