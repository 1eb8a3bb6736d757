package main

import "testing"

func TestParseSize(t *testing.T) {
	good := map[string]uint64{"512M": 512 << 20, "2G": 2 << 30, "2GiB": 2 << 30, "1024": 1024, "64k": 64 << 10, "1T": 1 << 40}
	for in, want := range good {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "M", "lots", "12X", "-1G", "99999999999999999999", "17179869184G"} {
		if got, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", in, got)
		}
	}
}
