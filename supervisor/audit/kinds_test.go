package audit

import (
	"bytes"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// dataTypes are the types of the data of each kind carreld writes
// (kinds.go). Writers build them and review and rerun decode into them,
// so a kind whose data has no type here can drift between the two.
// Values that are set here are kept by fill: an intent's action picks
// its type.
var dataTypes = map[string][]any{
	KindVMLifecycle:    {Lifecycle{}},
	KindAPICall:        {APICall{}},
	KindPolicyDecision: {Decision{}},
	KindIntent: {
		ExecIntent{Action: ActionExec},
		ExecIntentTruncated{Action: ActionExec},
		FileIntent{Action: "file.write"},
		ForwardIntent{Action: ActionForward},
		InputIntent{Action: ActionInput},
	},
	KindExecExit:     {ExecExit{}},
	KindExecOutput:   {ExecOutput{}},
	KindFileOp:       {FileOp{}},
	KindWatchEvent:   {Watch{}},
	KindFileActivity: {Activity{}},
	KindNetEgress:    {Egress{}},
	KindOutcome:      {ForwardOutcome{}, OutcomeData{}, InputOutcome{}},
	KindGPUAttach:    {GPU{}},
	KindGPUDetach:    {GPU{}},
	KindRecovery:     {RecoveryData{}},
	KindWitness:      {WitnessEvent{}},
	KindSegment:      {SegmentStart{}},
}

// notWritten are the kinds carreld writes no data of, and why.
var notWritten = map[string]string{
	// tests/bench writes exec.start records with a body of its own (argv,
	// env, cwd, user, pid) as a typical record's size; no reader reads it.
	KindExecStart:    "only tests/bench writes it",
	KindGuestRequest: "reserved: nothing writes it yet",
}

// TestEveryKindHasItsType: every Kind constant in record.go is in
// dataTypes or notWritten, so a new kind needs its data's type.
func TestEveryKindHasItsType(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "record.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]string{} // value: constant
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			for i, n := range vs.Names {
				if !strings.HasPrefix(n.Name, "Kind") || i >= len(vs.Values) {
					continue
				}
				lit, ok := vs.Values[i].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Errorf("%s is not a string literal", n.Name)
					continue
				}
				v, _ := strconv.Unquote(lit.Value)
				kinds[v] = n.Name
			}
		}
	}
	if len(kinds) < len(dataTypes) {
		t.Fatalf("found %d Kind constants in record.go, fewer than the %d kinds with types", len(kinds), len(dataTypes))
	}
	for v, name := range kinds {
		_, typed := dataTypes[v]
		_, exempt := notWritten[v]
		switch {
		case typed && exempt:
			t.Errorf("%s (%q) has a type and is listed as not written", name, v)
		case !typed && !exempt:
			t.Errorf("%s (%q) has no type for its data in dataTypes: add one to kinds.go", name, v)
		}
	}
	for _, m := range []map[string]bool{keys(dataTypes), keys(notWritten)} {
		for v := range m {
			if kinds[v] == "" {
				t.Errorf("%q is not a Kind constant of record.go", v)
			}
		}
	}
}

func keys[V any](m map[string]V) map[string]bool {
	out := map[string]bool{}
	for k := range m {
		out[k] = true
	}
	return out
}

// TestKindsRoundTrip: each type's every field, set, is written and read
// back as it was, and what it writes has no field it cannot read (as a
// reader that refuses unknown fields would see it).
func TestKindsRoundTrip(t *testing.T) {
	for kind, types := range dataTypes {
		for _, v := range types {
			typ := reflect.TypeOf(v)
			want := reflect.New(typ)
			want.Elem().Set(reflect.ValueOf(v))
			fill(t, want.Elem())
			b, err := json.Marshal(want.Interface())
			if err != nil {
				t.Fatalf("%s %s: %v", kind, typ, err)
			}
			if len(b) > MaxDataSize {
				t.Errorf("%s %s: %d bytes", kind, typ, len(b))
			}
			got := reflect.New(typ)
			d := json.NewDecoder(bytes.NewReader(b))
			d.DisallowUnknownFields()
			if err := d.Decode(got.Interface()); err != nil {
				t.Errorf("%s %s: %s does not decode: %v", kind, typ, b, err)
				continue
			}
			if !reflect.DeepEqual(got.Interface(), want.Interface()) {
				t.Errorf("%s %s: %s reads back as\n%+v, want\n%+v", kind, typ, b, got.Elem(), want.Elem())
			}
			if again, _ := json.Marshal(got.Interface()); !bytes.Equal(again, b) {
				t.Errorf("%s %s: writes %s, then %s", kind, typ, b, again)
			}
			if kind != KindIntent {
				continue
			}
			in, err := DecodeIntent(b)
			if err != nil || !reflect.DeepEqual(in, want.Interface()) {
				t.Errorf("DecodeIntent(%s) = %#v, %v; want %#v", b, in, err, want.Interface())
			}
		}
	}
}

// TestCallerJSON: a caller writes the fields its type has, all of them
// (policy.Caller is this type, so decisions' inputs read the same).
func TestCallerJSON(t *testing.T) {
	for _, c := range []struct {
		c    Caller
		want string
	}{
		{Caller{Type: "peer"}, `{"type":"peer","uid":0,"gid":0,"pid":0,"groups":[]}`},
		{Caller{Type: "peer", UID: 1000, GID: 100, PID: 42, Groups: []string{"users"}, TokenID: "x", VM: "y"},
			`{"type":"peer","uid":1000,"gid":100,"pid":42,"groups":["users"]}`},
		{Caller{Type: "token", TokenID: "t1", VM: "demo", UID: 5}, `{"type":"token","token_id":"t1","vm":"demo"}`},
		{Caller{Type: "token"}, `{"type":"token","token_id":"","vm":""}`},
		{Caller{Type: "other", UID: 5}, `{"type":"other"}`},
	} {
		b, err := json.Marshal(c.c)
		if err != nil || string(b) != c.want {
			t.Errorf("%+v: %s, %v; want %s", c.c, b, err, c.want)
		}
		var got Caller
		d := json.NewDecoder(bytes.NewReader(b))
		d.DisallowUnknownFields()
		if err := d.Decode(&got); err != nil {
			t.Errorf("%s: %v", b, err)
		}
	}
}

// fill sets every field of v that is zero to a value that is not, the
// way a writer that sets everything would. A Caller is a peer's: a
// caller writes only its type's fields (TestCallerJSON).
func fill(t *testing.T, v reflect.Value) {
	t.Helper()
	if !v.IsZero() && v.Kind() != reflect.Struct {
		return
	}
	switch v.Interface().(type) {
	case Caller:
		if v.IsZero() {
			v.Set(reflect.ValueOf(Caller{Type: "peer", UID: 1000, GID: 1000, PID: 42, Groups: []string{"users"}}))
		}
		return
	case time.Time:
		v.Set(reflect.ValueOf(time.Date(2026, 11, 26, 1, 2, 3, 4, time.UTC)))
		return
	case json.RawMessage:
		v.Set(reflect.ValueOf(json.RawMessage(`{"k":["v",1]}`)))
		return
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString("x-" + v.Type().Name())
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(7)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(9)
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(t, v.Elem())
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fill(t, v.Index(0))
	case reflect.Array:
		for i := range v.Len() {
			fill(t, v.Index(i))
		}
	case reflect.Map:
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fill(t, k)
		fill(t, e)
		v.Set(reflect.MakeMap(v.Type()))
		v.SetMapIndex(k, e)
	case reflect.Struct:
		for i := range v.NumField() {
			if !v.Type().Field(i).IsExported() {
				t.Fatalf("%s has an unexported field %s: record data is its JSON", v.Type(), v.Type().Field(i).Name)
			}
			fill(t, v.Field(i))
		}
	default:
		t.Fatalf("fill: %s", v.Type())
	}
}
