package agentlink

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// A guest that sends endless empty frames of another transfer before the
// transfer's own cannot keep Next (and the client behind it) waiting
// forever: what it passes over is bounded, and ctx ending stops it.
func TestDataPortEmptyStaleFramesAreBounded(t *testing.T) {
	l, guest := rawPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	in := l.ReceiveData(ctx)
	if in == nil {
		t.Fatal("no data port")
	}
	stale := protocol.AppendFrame(nil, protocol.Frame{ID: in.ID ^ 1})
	go func() {
		for {
			if _, err := guest.Write(stale); err != nil {
				return
			}
		}
	}()
	got := make(chan error, 1)
	go func() {
		_, err := in.Next(ctx)
		got <- err
	}()
	select {
	case err := <-got:
		if err == nil {
			t.Fatal("a payload out of stale frames")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Next still passing over empty stale frames 4s after its ctx ended")
	}
}

// Close reads what is left of a transfer begun, but a guest that never
// ends it cannot keep Close (and the transfer token) forever.
func TestDataPortCloseDrainIsBounded(t *testing.T) {
	defer func(d time.Duration) { closeDrainLimit = d }(closeDrainLimit)
	closeDrainLimit = 300 * time.Millisecond
	l, guest := rawPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	in := l.ReceiveData(ctx)
	if in == nil {
		t.Fatal("no data port")
	}
	go func() {
		for seq := uint32(0); ; seq++ {
			b := protocol.AppendFrame(nil, protocol.Frame{ID: in.ID, Seq: seq, Length: 1})
			if _, err := guest.Write(append(b, 'x')); err != nil {
				return
			}
		}
	}()
	if _, err := in.Next(ctx); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() {
		in.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close still draining a transfer the guest never ends")
	}
}

// The first transfer after a dropped connection (or a new carreld) may
// pass over what is left of the guest's frame. One closed before it read
// anything (the guest refused the call) leaves that to the next.
func TestDataPortResyncSurvivesUnreadTransfer(t *testing.T) {
	l, guest := rawPair(t)
	l.data.resyncIn = true // as a new carreld's first connection
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	refused := l.ReceiveData(ctx)
	if refused == nil {
		t.Fatal("no data port")
	}
	refused.Close()
	in := l.ReceiveData(ctx)
	if in == nil {
		t.Fatal("no data port")
	}
	defer in.Close()
	// The tail of the last carreld's frame, then this transfer's.
	tail := make([]byte, 100)
	for i := range tail {
		tail[i] = 'x'
	}
	go guest.Write(append(tail, protocol.AppendFrame(nil, protocol.Frame{Flags: protocol.FrameEnd, ID: in.ID})...))
	if _, err := in.Next(ctx); err != io.EOF {
		t.Fatalf("got %v, want the transfer's end past the old frame's tail", err)
	}
	if errors.Is(in.err, ErrDataProtocol) || !l.DataPortInUse() {
		t.Fatal("the data port was turned off")
	}
}
