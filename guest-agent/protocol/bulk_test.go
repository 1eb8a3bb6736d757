package protocol

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

func TestFrameRoundTrip(t *testing.T) {
	for _, f := range []Frame{
		{ID: 1},
		{Flags: FrameEnd, ID: 1<<64 - 1, Seq: 7, Length: MaxDataFrameBytes},
		{Flags: FrameAbort, ID: 42, Seq: 1<<32 - 1},
	} {
		b := AppendFrame(nil, f)
		if len(b) != FrameHeaderSize {
			t.Fatalf("header of %d bytes", len(b))
		}
		got, err := ParseFrame(b)
		if err != nil || got != f {
			t.Fatalf("ParseFrame(AppendFrame(%+v)) = %+v, %v", f, got, err)
		}
	}
}

func TestParseFrameRefuses(t *testing.T) {
	for name, f := range map[string]Frame{
		"id 0":                 {Length: 1},
		"too long":             {ID: 1, Length: MaxDataFrameBytes + 1},
		"unknown flag":         {ID: 1, Flags: 1 << 5},
		"end and abort":        {ID: 1, Flags: FrameEnd | FrameAbort},
		"abort with a payload": {ID: 1, Flags: FrameAbort, Length: 1},
	} {
		if _, err := ParseFrame(AppendFrame(nil, f)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	b := AppendFrame(nil, Frame{ID: 1})
	b[0] ^= 1
	if _, err := ParseFrame(b); !errors.Is(err, ErrFrameMagic) {
		t.Errorf("bad magic: %v", err)
	}
	if _, err := ParseFrame(b[:FrameHeaderSize-1]); err == nil {
		t.Error("short header accepted")
	}
}

// A reader that lands inside a frame (after a reconnect) finds the next
// one; with MaxSkip 0 it refuses the first byte that does not start one.
func TestFrameReaderResync(t *testing.T) {
	var stream []byte
	stream = append(stream, "the tail of a frame cut short, CULK without a header"...)
	stream = AppendFrame(stream, Frame{ID: 9, Seq: 0, Length: 3})
	stream = append(stream, "abc"...)
	stream = AppendFrame(stream, Frame{Flags: FrameEnd, ID: 9, Seq: 1})

	fr := NewFrameReader(bytes.NewReader(stream))
	f, skipped, err := fr.Next()
	if err != nil || f.ID != 9 || f.Length != 3 || skipped != int64(len("the tail of a frame cut short, CULK without a header")) {
		t.Fatalf("Next = %+v, %d, %v", f, skipped, err)
	}
	p, err := fr.Payload(f, make([]byte, 3))
	if err != nil || string(p) != "abc" {
		t.Fatalf("Payload = %q, %v", p, err)
	}
	if f, _, err := fr.Next(); err != nil || f.Flags != FrameEnd {
		t.Fatalf("last frame: %+v, %v", f, err)
	}
	if _, _, err := fr.Next(); err != io.EOF {
		t.Fatalf("after the last frame: %v", err)
	}

	strict := NewFrameReader(bytes.NewReader(stream))
	strict.MaxSkip = 0
	if _, _, err := strict.Next(); !errors.Is(err, ErrFrameMagic) {
		t.Fatalf("strict reader: %v", err)
	}
	bounded := NewFrameReader(bytes.NewReader(stream))
	bounded.MaxSkip = 10
	if _, skipped, err := bounded.Next(); err == nil || skipped != 10 {
		t.Fatalf("bounded reader: skipped %d, %v", skipped, err)
	}
}

func TestFrameReaderTruncatedPayload(t *testing.T) {
	stream := AppendFrame(nil, Frame{ID: 1, Length: 10})
	stream = append(stream, "short"...)
	fr := NewFrameReader(bytes.NewReader(stream))
	f, _, err := fr.Next()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fr.Payload(f, make([]byte, 10)); err != io.ErrUnexpectedEOF {
		t.Fatalf("Payload of a cut frame: %v", err)
	}
}

// FuzzFrameReader feeds the host's strict reader what a guest may send:
// it must never accept a frame ParseFrame would refuse, never read a
// payload past its length, and never panic.
func FuzzFrameReader(f *testing.F) {
	f.Add(AppendFrame(nil, Frame{ID: 1, Length: 2}), int64(0))
	f.Add(append([]byte("xxCULK"), AppendFrame(nil, Frame{Flags: FrameEnd, ID: 3})...), int64(8))
	f.Add([]byte("CULK\xff\xff\xff\xff"), int64(-1))
	f.Fuzz(func(t *testing.T, b []byte, maxSkip int64) {
		fr := NewFrameReader(bytes.NewReader(b))
		fr.MaxSkip = maxSkip
		buf := make([]byte, MaxDataFrameBytes)
		var total int64
		for range 64 {
			f, skipped, err := fr.Next()
			if maxSkip >= 0 && skipped > maxSkip {
				t.Fatalf("skipped %d, over %d", skipped, maxSkip)
			}
			if err != nil {
				return
			}
			if f.Length > MaxDataFrameBytes || f.ID == 0 || f.Flags == FrameEnd|FrameAbort || f.Flags&^frameFlags != 0 || (f.Flags == FrameAbort && f.Length != 0) {
				t.Fatalf("accepted %+v", f)
			}
			total += skipped + FrameHeaderSize
			p, err := fr.Payload(f, buf)
			if err != nil {
				return
			}
			if len(p) != int(f.Length) {
				t.Fatalf("payload of %d bytes for a length of %d", len(p), f.Length)
			}
			total += int64(f.Length)
			if total > int64(len(b)) {
				t.Fatalf("read %d bytes of %d", total, len(b))
			}
		}
	})
}
