package tests

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestDataPort shows file content crossing the data port of a
// virtio-serial VM: carreld says it uses it, content of every size
// arrives whole both ways, a write the guest refuses before reading its
// content fails with the guest's reason, a client that gives up writes
// nothing, and the port goes on working after each.
func TestDataPort(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "dp")
	var info struct {
		Transport string `json:"transport"`
		DataPort  bool   `json:"dataPort"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "dp")), &info); err != nil {
		t.Fatal(err)
	}
	if info.Transport == "virtio-serial" && !info.DataPort {
		t.Fatalf("a virtio-serial VM does not use its data port: %+v", info)
	}

	c := client.New(d.Socket)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	roundTrip := func(size int) {
		t.Helper()
		data := make([]byte, size)
		rand.Read(data)
		if _, err := c.Upload(ctx, "dp", "/tmp/dp", bytes.NewReader(data), 0); err != nil {
			t.Fatalf("upload of %d bytes: %v", size, err)
		}
		var back bytes.Buffer
		if _, err := c.Download(ctx, "dp", "/tmp/dp", &back); err != nil {
			t.Fatalf("download of %d bytes: %v", size, err)
		}
		if !bytes.Equal(back.Bytes(), data) {
			t.Fatalf("%d bytes sent, %d different bytes back", size, back.Len())
		}
	}
	for _, size := range []int{0, 1, 1<<20 - 1, 1 << 20, 1<<20 + 1, 24 << 20} {
		roundTrip(size)
	}

	// Refused by the guest before it reads the content: the guest's
	// reason, in far less than the time a blocked sender would wait.
	start := time.Now()
	_, err := c.Upload(ctx, "dp", "/tmp/dp/under-a-file", bytes.NewReader(make([]byte, 16<<20)), 0)
	if err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("upload under a regular file: %v", err)
	}
	if el := time.Since(start); el > 8*time.Second {
		t.Errorf("the refused upload took %s", el)
	}
	roundTrip(3 << 20)

	// A client that gives up mid-way leaves the old file in place.
	before := d.Must("exec", "dp", "--", "sha256sum", "/tmp/dp")
	up, stop := context.WithCancel(ctx)
	_, err = c.Upload(up, "dp", "/tmp/dp", io.MultiReader(bytes.NewReader(make([]byte, 4<<20)), readerFunc(func([]byte) (int, error) {
		stop()
		return 0, errors.New("the client gave up")
	})), 0)
	if err == nil {
		t.Fatal("an abandoned upload succeeded")
	}
	if after := d.Must("exec", "dp", "--", "sha256sum", "/tmp/dp"); after != before {
		t.Fatalf("an abandoned upload changed the file: %q, was %q", after, before)
	}
	roundTrip(2 << 20)

	// A download of part of a file, and one the client stops reading.
	s, err := c.Files.Read(ctx, client.ForVM("dp", &agentv1.ReadRequest{Path: "/tmp/dp", Offset: 1 << 20, Length: 5}))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for s.Receive() {
		n += len(s.Msg().Data)
	}
	if s.Err() != nil || n != 5 {
		t.Fatalf("ranged read: %d bytes, %v", n, s.Err())
	}
	d.Must("exec", "dp", "--", "dd", "if=/dev/zero", "of=/tmp/big", "bs=1M", "count=32")
	rctx, rstop := context.WithCancel(ctx)
	s, err = c.Files.Read(rctx, client.ForVM("dp", &agentv1.ReadRequest{Path: "/tmp/big"}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	rstop()
	s.Close()
	roundTrip(5 << 20)
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "dp")), &info); err != nil {
		t.Fatal(err)
	}
	if info.Transport == "virtio-serial" && !info.DataPort {
		t.Fatal("the data port was turned off")
	}
	d.Must("vm", "rm", "--force", "dp")
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(b []byte) (int, error) { return f(b) }
