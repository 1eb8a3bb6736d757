//go:build linux

package activity

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// fanEvent builds one event as the kernel lays it out.
func fanEvent(mask uint64, pid int32, infos ...[]byte) []byte {
	le := binary.NativeEndian
	var info []byte
	for _, i := range infos {
		info = append(info, i...)
	}
	b := make([]byte, metadataBytes, metadataBytes+len(info))
	le.PutUint32(b[0:], uint32(metadataBytes+len(info)))
	b[4] = unix.FANOTIFY_METADATA_VERSION
	le.PutUint16(b[6:], metadataBytes)
	le.PutUint64(b[8:], mask)
	le.PutUint32(b[16:], uint32(0xffffffff)) // FAN_NOFD
	le.PutUint32(b[20:], uint32(pid))
	return append(b, info...)
}

// fidInfo builds an info record of typ: fsid, handle, and name (with its
// NUL and padding to 4 bytes) when name is not "".
func fidInfo(typ uint8, handle []byte, name string) []byte {
	le := binary.NativeEndian
	b := make([]byte, infoHeaderSize+fsidBytes+8)
	b[0] = typ
	le.PutUint32(b[infoHeaderSize+fsidBytes:], uint32(len(handle)))
	le.PutUint32(b[infoHeaderSize+fsidBytes+4:], 1) // handle type
	b = append(b, handle...)
	if name != "" {
		b = append(b, name...)
		b = append(b, 0)
	}
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	le.PutUint16(b[2:], uint16(len(b)))
	return b
}

func parseAll(t *testing.T, buf []byte) ([]rawEvent, error) {
	t.Helper()
	var evs []rawEvent
	err := parseEvents(buf, func(e rawEvent) { evs = append(evs, e) })
	return evs, err
}

func TestParseEvents(t *testing.T) {
	dir, child := []byte("dir-handle-8"), []byte("child-handle")
	buf := slices.Concat(
		fanEvent(unix.FAN_CREATE|unix.FAN_ONDIR, 42,
			fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, dir, "sub"),
			fidInfo(unix.FAN_EVENT_INFO_TYPE_FID, child, "")),
		fanEvent(unix.FAN_MODIFY, 43, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, dir, "a.txt")),
		fanEvent(unix.FAN_MODIFY, 44, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID, dir, "")),
		fanEvent(unix.FAN_Q_OVERFLOW, 0),
	)
	evs, err := parseAll(t, buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 4 {
		t.Fatalf("%d events, want 4", len(evs))
	}
	e := evs[0]
	if e.mask != unix.FAN_CREATE|unix.FAN_ONDIR || e.pid != 42 || e.fd != -1 || !e.hasDir || !bytes.Equal(e.dir.bytes, dir) ||
		e.dir.typ != 1 || !e.hasName || e.name != "sub" || !e.hasChild || !bytes.Equal(e.child.bytes, child) {
		t.Errorf("first event: %+v", e)
	}
	if e := evs[1]; e.pid != 43 || e.name != "a.txt" || e.hasChild {
		t.Errorf("second event: %+v", e)
	}
	if e := evs[2]; !e.hasDir || e.hasName {
		t.Errorf("third event (a directory handle, no name): %+v", e)
	}
	if e := evs[3]; e.mask != unix.FAN_Q_OVERFLOW || e.hasDir {
		t.Errorf("overflow: %+v", e)
	}
}

func TestParseEventsRefusesMalformed(t *testing.T) {
	good := fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("h"), "f"))
	badVersion := slices.Clone(good)
	badVersion[4] = 2
	longLen := slices.Clone(good)
	binary.NativeEndian.PutUint32(longLen[0:], uint32(len(good)+1))
	noNUL := fanEvent(unix.FAN_OPEN, 1, func() []byte {
		b := append(fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("hand"), ""), "name"...)
		binary.NativeEndian.PutUint16(b[2:], uint16(len(b)))
		return b
	}())
	tests := map[string][]byte{
		"truncated":       good[:len(good)-1],
		"short header":    good[:10],
		"version":         badVersion,
		"length":          longLen,
		"handle too long": fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, make([]byte, maxHandleBytes+1), "f")),
		"empty handle":    fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, nil, "f")),
		"slash":           fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("h"), "a/b")),
		"dotdot":          fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("h"), "..")),
		"name too long":   fanEvent(unix.FAN_OPEN, 1, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("h"), string(bytes.Repeat([]byte("n"), maxNameBytes+1)))),
		"no NUL":          noNUL,
	}
	for name, buf := range tests {
		if _, err := parseAll(t, buf); !errors.Is(err, errBadEvent) {
			t.Errorf("%s: %v, want errBadEvent", name, err)
		}
	}
}

func TestOpsOf(t *testing.T) {
	tests := []struct {
		mask uint64
		want []Op
	}{
		{unix.FAN_OPEN, []Op{Open}},
		{unix.FAN_OPEN | unix.FAN_ONDIR, nil}, // a listing
		{unix.FAN_MODIFY | unix.FAN_OPEN | unix.FAN_CREATE, []Op{Create, Open, Modify}},
		{unix.FAN_CREATE | unix.FAN_ONDIR, []Op{Create}},
		{unix.FAN_DELETE | unix.FAN_ONDIR, []Op{Delete}},
		{unix.FAN_MOVED_FROM, []Op{MoveFrom}},
		{unix.FAN_MOVED_TO | unix.FAN_ONDIR, []Op{MoveTo}},
		{unix.FAN_CLOSE_WRITE, nil},
	}
	for _, tt := range tests {
		if got := opsOf(tt.mask); !slices.Equal(got, tt.want) {
			t.Errorf("opsOf(%#x) = %v, want %v", tt.mask, got, tt.want)
		}
	}
}

// procMsg builds one connector datagram: a fork or an exit.
func procMsg(what uint32, a, b, c, d int32) []byte {
	le := binary.NativeEndian
	msg := make([]byte, nlmsgHdrBytes+cnMsgBytes+procEventHeader+24)
	le.PutUint32(msg[0:], uint32(len(msg)))
	le.PutUint16(msg[4:], unix.NLMSG_DONE)
	cn := msg[nlmsgHdrBytes:]
	le.PutUint32(cn[0:], cnIdxProc)
	le.PutUint32(cn[4:], cnValProc)
	le.PutUint16(cn[16:], procEventHeader+24)
	ev := cn[cnMsgBytes:]
	le.PutUint32(ev[0:], what)
	for i, v := range []int32{a, b, c, d} {
		le.PutUint32(ev[procEventHeader+4*i:], uint32(v))
	}
	return msg
}

func TestParseProcEvents(t *testing.T) {
	var got []procEvent
	fn := func(e procEvent) { got = append(got, e) }
	parseProcEvents(procMsg(procEventFork, 10, 10, 11, 11), fn)
	parseProcEvents(procMsg(procEventExit, 11, 11, 0, 0), fn)
	parseProcEvents(procMsg(0x2 /* exec */, 11, 11, 0, 0), fn)
	other := procMsg(procEventFork, 1, 1, 2, 2)
	binary.NativeEndian.PutUint32(other[nlmsgHdrBytes:], 7) // another connector
	parseProcEvents(other, fn)
	parseProcEvents(procMsg(procEventFork, 1, 1, 2, 2)[:40], fn) // truncated
	want := []procEvent{{fork: true, parentTgid: 10, pid: 11, tgid: 11}, {pid: 11, tgid: 11}}
	if !slices.Equal(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
}

// FuzzParseEvents checks that no buffer makes the fanotify parser panic
// or return an event out of bounds.
func FuzzParseEvents(f *testing.F) {
	f.Add(fanEvent(unix.FAN_CREATE, 42, fidInfo(unix.FAN_EVENT_INFO_TYPE_DFID_NAME, []byte("dir"), "f"), fidInfo(unix.FAN_EVENT_INFO_TYPE_FID, []byte("c"), "")))
	f.Add(fanEvent(unix.FAN_Q_OVERFLOW, 0))
	f.Add(procMsg(procEventFork, 1, 1, 2, 2))
	f.Fuzz(func(t *testing.T, b []byte) {
		_ = parseEvents(b, func(e rawEvent) {
			if e.hasDir && (len(e.dir.bytes) == 0 || len(e.dir.bytes) > maxHandleBytes) {
				t.Fatalf("handle of %d bytes", len(e.dir.bytes))
			}
			if e.hasName && (e.name == "" || len(e.name) > maxNameBytes || e.name == ".." || bytes.ContainsAny([]byte(e.name), "/\x00")) {
				t.Fatalf("name %q", e.name)
			}
		})
		parseProcEvents(b, func(procEvent) {})
	})
}
