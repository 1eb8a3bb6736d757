package main

import "testing"

func TestSplitGuest(t *testing.T) {
	cases := []struct {
		arg, vm, path string
		guest         bool
	}{
		{"demo:/etc/hosts", "demo", "/etc/hosts", true},
		{"vm-1:/", "vm-1", "/", true},
		{"./demo:/x", "", "./demo:/x", false},
		{"demo:rel", "", "demo:rel", false},
		{"Demo:/x", "", "Demo:/x", false},
		{"/tmp/file", "", "/tmp/file", false},
		{"-", "", "-", false},
	}
	for _, c := range cases {
		vm, p, ok := splitGuest(c.arg)
		if vm != c.vm || p != c.path || ok != c.guest {
			t.Errorf("splitGuest(%q) = %q, %q, %v", c.arg, vm, p, ok)
		}
	}
}
