package relay

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"connectrpc.com/connect"
)

// TestRelayErrCodes checks what a client is told when a call to the guest
// fails: the guest's own error rebuilt, the relay's refusals and size caps
// as they are, the caller's own cancel as it is, and anything else (the
// link breaking under the call) as Unavailable, whatever the transport
// called it.
func TestRelayErrCodes(t *testing.T) {
	var reported []error
	done := func(_ context.Context, err error) error { reported = append(reported, err); return err }
	live := context.Background()
	gone, cancel := context.WithCancel(context.Background())
	cancel()

	tests := []struct {
		name     string
		ctx      context.Context
		err      error
		code     connect.Code
		contains string
	}{
		{"the guest's error", live, connect.NewWireError(connect.CodeNotFound, errors.New("no such file")), connect.CodeNotFound, "guest agent: no such file"},
		{"a reply the relay refused", live, errGuest("invalid path %q", "x"), connect.CodeDataLoss, "invalid path"},
		{"a message over the cap", live, connect.NewError(connect.CodeResourceExhausted, errors.New("message size 1048580 is larger than configured max 1048576")), connect.CodeResourceExhausted, "larger than configured max"},
		{"a lost connection", live, connect.NewError(connect.CodeUnknown, errors.New("read enveloped message: http2: client connection lost")), connect.CodeUnavailable, "the link to the guest agent broke"},
		{"a stream cut mid-message", live, connect.NewError(connect.CodeInvalidArgument, errors.New("protocol error: incomplete envelope")), connect.CodeUnavailable, "incomplete envelope"},
		{"a plain transport error", live, io.ErrUnexpectedEOF, connect.CodeUnavailable, "reconnects on the next call"},
		{"the caller gave up", gone, connect.NewError(connect.CodeCanceled, context.Canceled), connect.CodeCanceled, ""},
	}
	for _, tt := range tests {
		err := relayErr(tt.ctx, done, tt.err)
		if connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.contains) {
			t.Errorf("%s: got %v, want code %v with %q", tt.name, err, tt.code, tt.contains)
		}
	}
	if len(reported) != len(tests) {
		t.Errorf("the link was told of %d errors, want all %d", len(reported), len(tests))
	}
	if err := relayErr(live, done, nil); err != nil {
		t.Errorf("no error became %v", err)
	}
}
