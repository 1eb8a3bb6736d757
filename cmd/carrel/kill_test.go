package main

import "testing"

func TestParseSignal(t *testing.T) {
	for in, want := range map[string]int32{"TERM": 15, "sigkill": 9, "SIGINT": 2, "9": 9, "64": 64} {
		if got, err := parseSignal(in); err != nil || got != want {
			t.Errorf("parseSignal(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "65", "NOPE", "-1"} {
		if _, err := parseSignal(in); err == nil {
			t.Errorf("parseSignal(%q) accepted", in)
		}
	}
}
