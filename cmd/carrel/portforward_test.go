package main

import "testing"

func TestParsePortSpec(t *testing.T) {
	for in, want := range map[string]portSpec{
		"8080:80": {local: 8080, remote: 80},
		"0:3000":  {local: 0, remote: 3000},
		"5432":    {local: 5432, remote: 5432},
	} {
		if got, err := parsePortSpec(in); err != nil || got != want {
			t.Errorf("%q: %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "80:0", "x:80", "80:x", "70000:80", "80:70000", "1:2:3", "-1:80", ":80", "80:"} {
		if got, err := parsePortSpec(in); err == nil {
			t.Errorf("%q accepted as %+v", in, got)
		}
	}
}
