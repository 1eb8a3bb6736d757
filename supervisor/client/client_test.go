package client

import "testing"

func TestSocketFromEnv(t *testing.T) {
	t.Setenv("CARREL_SOCKET", "")
	if got := SocketFromEnv(); got != DefaultSocket {
		t.Errorf("default = %q", got)
	}
	t.Setenv("CARREL_SOCKET", "/tmp/x.sock")
	if got := SocketFromEnv(); got != "/tmp/x.sock" {
		t.Errorf("override = %q", got)
	}
}
