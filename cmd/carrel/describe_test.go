package main

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
)

// TestDescribeUnavailable: Unavailable that carreld sent (its audit log
// is down, or it paused the VM under the call) is carreld's reason, not
// "cannot reach carreld", which is for a carreld that never answered.
func TestDescribeUnavailable(t *testing.T) {
	sent := connect.NewWireError(connect.CodeUnavailable, errors.New("the call was ended: the vm is paused: audit log unavailable: no space left on device"))
	if got := describe(sent); strings.Contains(got, "cannot reach") || !strings.Contains(got, "audit log unavailable") {
		t.Errorf("carreld's own Unavailable: %q", got)
	}
	dial := connect.NewError(connect.CodeUnavailable, errors.New("dial unix /run/carrel/carreld.sock: connect: no such file or directory"))
	if got := describe(dial); !strings.HasPrefix(got, "cannot reach carreld") {
		t.Errorf("a carreld out of reach: %q", got)
	}
}
