//go:build linux

package proctable

import (
	"context"
	"testing"
	"time"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func out(s string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte(s)}}
}

func errOut(s string) *agentv1.ExecResponse {
	return &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: []byte(s)}}
}

// drain reads everything up to the exit status.
func drain(t *testing.T, b *outbuf) (string, *agentv1.ExitStatus) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var got string
	for {
		c, exit, err := b.next(ctx)
		if err != nil {
			t.Fatalf("next: %v (so far %q)", err, got)
		}
		if exit != nil {
			return got, exit
		}
		if c.stderr {
			got += "!"
		}
		got += string(c.data)
		b.consume(len(c.data))
	}
}

func TestOutbufDropsOldest(t *testing.T) {
	b := newOutbuf(10)
	buf := []byte("abcdef")
	m := &agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{Stdout: buf}}
	b.write(m)
	copy(buf, "XXXXXX") // the writer reuses its buffer
	b.write(errOut("ghijkl"))
	b.write(out(""))
	b.write(out("mnopqrstuvw")) // longer than the buffer: only its tail stays
	b.finish(&agentv1.ExitStatus{Code: 3})
	dropped, ok := b.attach(context.Background(), 0)
	if !ok || dropped != 6+6+1 {
		t.Fatalf("attach: dropped %d ok %v", dropped, ok)
	}
	if _, ok := b.attach(context.Background(), 0); ok {
		t.Fatal("second attach allowed")
	}
	got, exit := drain(t, b)
	if got != "nopqrstuvw" || exit.Code != 3 {
		t.Fatalf("got %q exit %v", got, exit)
	}
	// Every attach replays what is kept.
	b.detach()
	if dropped, _ := b.attach(context.Background(), 0); dropped != 13 {
		t.Fatalf("second attach: dropped %d", dropped)
	}
	if got, _ := drain(t, b); got != "nopqrstuvw" {
		t.Fatalf("replay %q", got)
	}

	b = newOutbuf(10)
	b.write(out("abc"))
	b.write(out("def")) // joins abc
	b.write(errOut("ghijkl"))
	b.finish(&agentv1.ExitStatus{})
	b.attach(context.Background(), 0)
	if got, _ := drain(t, b); got != "cdef!ghijkl" {
		t.Fatalf("got %q", got)
	}
}

// TestOutbufWaitsForAttachedClient: with a client attached, bytes it has
// yet to read are never dropped; the writer waits instead.
func TestOutbufWaitsForAttachedClient(t *testing.T) {
	b := newOutbuf(10)
	b.attach(context.Background(), 0)
	b.write(out("12345678"))
	wrote := make(chan struct{})
	go func() {
		b.write(errOut("abcde"))
		close(wrote)
	}()
	select {
	case <-wrote:
		t.Fatal("write did not wait for the client")
	case <-time.After(50 * time.Millisecond):
	}
	ctx := context.Background()
	c, _, _ := b.next(ctx)
	if string(c.data) != "12345678" {
		t.Fatalf("next %q", c.data)
	}
	b.consume(2) // part of a chunk: 3 bytes would still be dropped
	select {
	case <-wrote:
		t.Fatal("write dropped unread bytes")
	case <-time.After(50 * time.Millisecond):
	}
	c, _, _ = b.next(ctx)
	if string(c.data) != "345678" || c.off != 2 {
		t.Fatalf("next %q at %d", c.data, c.off)
	}
	b.consume(1) // enough room now
	<-wrote
	b.consume(5)

	// Once the client goes, writes drop again.
	go func() {
		time.Sleep(20 * time.Millisecond)
		b.detach()
	}()
	b.write(out("fghijkl")) // waits for the detach
	b.write(out("XY"))
	b.finish(&agentv1.ExitStatus{})
	if dropped, _ := b.attach(context.Background(), 0); dropped != 12 {
		t.Fatalf("dropped %d", dropped)
	}
	if got, _ := drain(t, b); got != "!efghijklXY" {
		t.Fatalf("got %q", got)
	}
}

// TestOutbufChunkCap: output that flips between stdout and stderr keeps
// at most maxChunks chunks.
func TestOutbufChunkCap(t *testing.T) {
	b := newOutbuf(1 << 20)
	for i := range 3 * maxChunks {
		if i%2 == 0 {
			b.write(out("o"))
		} else {
			b.write(errOut("e"))
		}
	}
	b.finish(&agentv1.ExitStatus{})
	if len(b.chunks) != maxChunks {
		t.Fatalf("%d chunks", len(b.chunks))
	}
	if dropped, _ := b.attach(context.Background(), 0); dropped != 2*maxChunks {
		t.Fatalf("dropped %d", dropped)
	}
	got, _ := drain(t, b)
	if len(got) != maxChunks*3/2 || got[:3] != "o!e" {
		t.Fatalf("got %d bytes starting %q", len(got), got[:3])
	}
}

func TestOutbufNextEndsWithContext(t *testing.T) {
	b := newOutbuf(10)
	b.attach(context.Background(), 0)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	if _, _, err := b.next(ctx); err != context.Canceled {
		t.Fatalf("next: %v", err)
	}
}
