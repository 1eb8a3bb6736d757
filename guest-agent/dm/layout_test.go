//go:build linux

package dm

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The offsets we write by hand must agree with x/sys/unix's generated copy
// of the UAPI structs.
func TestOffsetsMatchUAPI(t *testing.T) {
	var h unix.DmIoctl
	var s unix.DmTargetSpec
	for _, c := range []struct {
		name      string
		ours, got uintptr
	}{
		{"header size", headerSize, unsafe.Sizeof(h)},
		{"version", offVersion, unsafe.Offsetof(h.Version)},
		{"data_size", offDataSize, unsafe.Offsetof(h.Data_size)},
		{"data_start", offDataStart, unsafe.Offsetof(h.Data_start)},
		{"target_count", offTargetCount, unsafe.Offsetof(h.Target_count)},
		{"open_count", offOpenCount, unsafe.Offsetof(h.Open_count)},
		{"flags", offFlags, unsafe.Offsetof(h.Flags)},
		{"event_nr", offEventNr, unsafe.Offsetof(h.Event_nr)},
		{"dev", offDev, unsafe.Offsetof(h.Dev)},
		{"name", offName, unsafe.Offsetof(h.Name)},
		{"uuid", offUUID, unsafe.Offsetof(h.Uuid)},
		{"spec size", specSize, unsafe.Sizeof(s)},
		{"sector_start", offSpecStart, unsafe.Offsetof(s.Sector_start)},
		{"length", offSpecLength, unsafe.Offsetof(s.Length)},
		{"status", offSpecStatus, unsafe.Offsetof(s.Status)},
		{"next", offSpecNext, unsafe.Offsetof(s.Next)},
		{"target_type", offSpecType, unsafe.Offsetof(s.Target_type)},
	} {
		if c.ours != c.got {
			t.Errorf("%s: we use %d, unix has %d", c.name, c.ours, c.got)
		}
	}
	if headerSize != 312 || specSize != 40 {
		t.Errorf("sizes %d, %d; want 312, 40", headerSize, specSize)
	}
}

// asHeader views buf as the kernel would.
func asHeader(t *testing.T, buf []byte) *unix.DmIoctl {
	t.Helper()
	if len(buf) < headerSize {
		t.Fatalf("buffer is %d bytes", len(buf))
	}
	return (*unix.DmIoctl)(unsafe.Pointer(&buf[0]))
}

func TestNewRequest(t *testing.T) {
	buf, err := newRequest("root", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(buf) != headerSize {
		t.Fatalf("len %d, want %d", len(buf), headerSize)
	}
	h := asHeader(t, buf)
	if h.Version != [3]uint32{4, 0, 0} {
		t.Errorf("version %v", h.Version)
	}
	if h.Data_size != headerSize || h.Data_start != headerSize {
		t.Errorf("data_size %d data_start %d", h.Data_size, h.Data_start)
	}
	if h.Target_count != 0 || h.Flags != 0 || h.Event_nr != 0 || h.Dev != 0 {
		t.Errorf("unexpected non-zero fields: %+v", h)
	}
	if got := cString(h.Name[:]); got != "root" {
		t.Errorf("name %q", got)
	}
	if !bytes.Equal(h.Uuid[:], make([]byte, len(h.Uuid))) {
		t.Error("uuid not zero")
	}

	buf, err = newRequest("root", 0, statusBufSize)
	if err != nil {
		t.Fatal(err)
	}
	if h := asHeader(t, buf); len(buf) != statusBufSize || h.Data_size != statusBufSize || h.Data_start != headerSize {
		t.Errorf("status request: len %d data_size %d data_start %d", len(buf), h.Data_size, h.Data_start)
	}

	long := strings.Repeat("n", maxNameLen)
	buf, err = newRequest(long, 0, 0)
	if err != nil {
		t.Fatalf("127-byte name: %v", err)
	}
	if h := asHeader(t, buf); h.Name[maxNameLen] != 0 || cString(h.Name[:]) != long {
		t.Error("127-byte name not stored with its NUL")
	}
}

func TestCheckName(t *testing.T) {
	for _, c := range []struct {
		name string
		ok   bool
	}{
		{"root", true},
		{"carrel-root_1.verity", true},
		{strings.Repeat("x", 127), true},
		{strings.Repeat("x", 128), false},
		{"", false},
		{"a/b", false},
		{"a\x00b", false},
		{".", false},
		{"..", false},
		{"control", false},
	} {
		err := checkName(c.name)
		if (err == nil) != c.ok {
			t.Errorf("checkName(%q) = %v, want ok=%v", c.name, err, c.ok)
		}
		if _, err := newRequest(c.name, 0, 0); (err == nil) != c.ok {
			t.Errorf("newRequest(%q) = %v, want ok=%v", c.name, err, c.ok)
		}
	}
}

func TestCheckTarget(t *testing.T) {
	good := Target{Length: 8, Type: "verity", Params: "1 /dev/vda /dev/vdb 4096 4096 2 1 sha256 ab cd"}
	if err := checkTarget(good); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		desc string
		mod  func(*Target)
		want string
	}{
		{"15-byte type", func(t *Target) { t.Type = strings.Repeat("t", 15) }, ""},
		{"16-byte type", func(t *Target) { t.Type = strings.Repeat("t", 16) }, "more than 15"},
		{"empty type", func(t *Target) { t.Type = "" }, "empty target type"},
		{"NUL in type", func(t *Target) { t.Type = "ver\x00ity" }, "contains NUL"},
		{"NUL in params", func(t *Target) { t.Params = "a\x00b" }, "parameters contain NUL"},
		{"non-zero start", func(t *Target) { t.Start = 1 }, "must start at 0"},
		{"zero length", func(t *Target) { t.Length = 0 }, "zero length"},
		{"empty params", func(t *Target) { t.Params = "" }, ""},
	} {
		tgt := good
		c.mod(&tgt)
		err := checkTarget(tgt)
		_, lerr := tableLoadRequest("root", tgt, unix.DM_READONLY_FLAG)
		if c.want == "" {
			if err != nil || lerr != nil {
				t.Errorf("%s: %v, %v", c.desc, err, lerr)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want error containing %q", c.desc, err, c.want)
		}
		if lerr == nil {
			t.Errorf("%s: tableLoadRequest accepted it", c.desc)
		}
	}
}

func TestTableLoadRequest(t *testing.T) {
	// Params lengths around the 8-byte boundary, counting the NUL.
	for _, n := range []int{0, 1, 6, 7, 8, 9, 15, 16, 200} {
		params := strings.Repeat("p", n)
		tgt := Target{Start: 0, Length: 123456789, Type: "verity", Params: params}
		buf, err := tableLoadRequest("root", tgt, unix.DM_READONLY_FLAG)
		if err != nil {
			t.Fatal(err)
		}
		padded := (n + 1 + 7) / 8 * 8
		if want := headerSize + specSize + padded; len(buf) != want {
			t.Fatalf("n=%d: len %d, want %d", n, len(buf), want)
		}
		if len(buf)%8 != 0 {
			t.Errorf("n=%d: len %d not 8-aligned", n, len(buf))
		}
		h := asHeader(t, buf)
		if h.Version != [3]uint32{4, 0, 0} || h.Data_size != uint32(len(buf)) || h.Data_start != headerSize ||
			h.Target_count != 1 || h.Flags != unix.DM_READONLY_FLAG || cString(h.Name[:]) != "root" {
			t.Errorf("n=%d: header %+v", n, *h)
		}
		spec := (*unix.DmTargetSpec)(unsafe.Pointer(&buf[h.Data_start]))
		if spec.Sector_start != 0 || spec.Length != 123456789 || spec.Status != 0 {
			t.Errorf("n=%d: spec %+v", n, *spec)
		}
		if spec.Next != uint32(specSize+padded) || spec.Next%8 != 0 {
			t.Errorf("n=%d: next %d, want %d", n, spec.Next, specSize+padded)
		}
		// The next spec would start exactly at the end of the buffer.
		if int(h.Data_start)+int(spec.Next) != len(buf) {
			t.Errorf("n=%d: next points to %d, buffer ends at %d", n, int(h.Data_start)+int(spec.Next), len(buf))
		}
		if want := append([]byte("verity"), make([]byte, 10)...); !bytes.Equal(spec.Target_type[:], want) {
			t.Errorf("n=%d: target_type %q", n, spec.Target_type)
		}
		p := buf[headerSize+specSize:]
		if string(p[:n]) != params {
			t.Errorf("n=%d: params %q", n, p[:n])
		}
		if !bytes.Equal(p[n:], make([]byte, len(p)-n)) || len(p)-n < 1 {
			t.Errorf("n=%d: params not NUL-terminated and zero-padded: %q", n, p[n:])
		}
		// The kernel's own bounds check (dm-ioctl.c next_target):
		// the spec must leave room for at least the NUL.
		if len(buf)-specSize <= headerSize {
			t.Errorf("n=%d: kernel would say the spec runs past the end", n)
		}
	}

	tgt := Target{Length: 8, Type: strings.Repeat("t", 15)}
	buf, err := tableLoadRequest("root", tgt, unix.DM_READONLY_FLAG)
	if err != nil {
		t.Fatal(err)
	}
	if typ := buf[headerSize+offSpecType : headerSize+specSize]; typ[15] != 0 || cString(typ) != tgt.Type {
		t.Errorf("15-byte type stored as %q", typ)
	}
}

// statusReply builds a DM_TABLE_STATUS reply as dm-ioctl.c retrieve_status
// does: specs from data_start, each followed by its NUL-terminated status,
// next counted from the first spec and 8-aligned, data_size = bytes used.
func statusReply(size int, targets ...targetStatus) []byte {
	buf := make([]byte, size)
	ne.PutUint32(buf[offVersion:], 4)
	ne.PutUint32(buf[offVersion+4:], 50)
	ne.PutUint32(buf[offDataStart:], headerSize)
	ne.PutUint32(buf[offTargetCount:], uint32(len(targets)))
	ne.PutUint32(buf[offFlags:], unix.DM_ACTIVE_PRESENT_FLAG|unix.DM_READONLY_FLAG)
	ne.PutUint32(buf[offDataSize:], 305) // what the kernel leaves when it writes no data
	out := headerSize
	for _, tg := range targets {
		spec := buf[out:]
		ne.PutUint64(spec[offSpecStart:], tg.Start)
		ne.PutUint64(spec[offSpecLength:], tg.Length)
		copy(spec[offSpecType:offSpecType+15], tg.Type)
		out += specSize
		out += copy(buf[out:], tg.Status) + 1
		ne.PutUint32(buf[offDataSize:], uint32(out))
		out = align8(out)
		ne.PutUint32(spec[offSpecNext:], uint32(out-headerSize))
	}
	return buf
}

func TestParseStatus(t *testing.T) {
	verity := targetStatus{Start: 0, Length: 2048, Type: "verity", Status: "V -"}
	linear := targetStatus{Start: 2048, Length: 100, Type: "linear", Status: ""}
	for _, c := range []struct {
		desc string
		buf  []byte
		want []targetStatus
	}{
		{"one verity target", statusReply(statusBufSize, verity), []targetStatus{verity}},
		{"buffer just large enough", statusReply(headerSize+specSize+4, verity), []targetStatus{verity}},
		{"empty status line", statusReply(512, linear), []targetStatus{linear}},
		{"two targets", statusReply(1024, verity, linear), []targetStatus{verity, linear}},
		{"no table", statusReply(512), nil},
	} {
		got, err := parseStatus(c.buf)
		if err != nil {
			t.Errorf("%s: %v", c.desc, err)
			continue
		}
		if len(got) != len(c.want) {
			t.Errorf("%s: got %+v, want %+v", c.desc, got, c.want)
			continue
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("%s: target %d: got %+v, want %+v", c.desc, i, got[i], c.want[i])
			}
		}
	}
}

func TestParseStatusMalformed(t *testing.T) {
	verity := targetStatus{Length: 2048, Type: "verity", Status: "V"}
	good := func() []byte { return statusReply(512, verity) }
	two := func() []byte { return statusReply(512, verity, verity) }
	for _, c := range []struct {
		desc string
		buf  []byte
		want string
	}{
		{"empty", nil, "shorter than"},
		{"short header", good()[:headerSize-1], "shorter than"},
		{"buffer full", func() []byte {
			b := good()
			ne.PutUint32(b[offFlags:], unix.DM_BUFFER_FULL_FLAG)
			return b
		}(), "does not fit"},
		{"data_size past buffer", func() []byte {
			b := good()
			ne.PutUint32(b[offDataSize:], 513)
			return b
		}(), "exceeds"},
		{"data_size past truncated buffer", good()[:headerSize+specSize], "exceeds"},
		{"data_start inside header", func() []byte {
			b := good()
			ne.PutUint32(b[offDataStart:], 100)
			return b
		}(), "inside the header"},
		{"data_start huge", func() []byte {
			b := good()
			ne.PutUint32(b[offDataStart:], 0xffffffff)
			return b
		}(), "runs past"},
		{"spec without room for a NUL", func() []byte {
			b := good()
			ne.PutUint32(b[offDataSize:], headerSize+specSize)
			return b
		}(), "runs past"},
		{"status without NUL", func() []byte {
			b := good()
			ne.PutUint32(b[offDataSize:], headerSize+specSize+1) // covers "V" only
			return b
		}(), "no NUL"},
		{"more targets than present", func() []byte {
			b := good()
			ne.PutUint32(b[offTargetCount:], 2)
			return b
		}(), "runs past"},
		{"huge target count", func() []byte {
			b := good()
			ne.PutUint32(b[offTargetCount:], 0xffffffff)
			return b
		}(), "runs past"},
		{"next points backwards", func() []byte {
			b := two()
			ne.PutUint32(b[headerSize+offSpecNext:], 0)
			return b
		}(), "overlaps"},
		{"next points into the status", func() []byte {
			b := two()
			ne.PutUint32(b[headerSize+offSpecNext:], specSize+1)
			return b
		}(), "overlaps"},
		{"next huge", func() []byte {
			b := two()
			ne.PutUint32(b[headerSize+offSpecNext:], 0xffffffff)
			return b
		}(), "runs past"},
	} {
		got, err := parseStatus(c.buf)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %+v, %v; want error containing %q", c.desc, got, err, c.want)
		}
	}
	b := good()
	ne.PutUint32(b[offFlags:], unix.DM_BUFFER_FULL_FLAG)
	if _, err := parseStatus(b); !errors.Is(err, errBufferFull) {
		t.Errorf("buffer full: %v, want errBufferFull", err)
	}
}

func FuzzParseStatus(f *testing.F) {
	verity := targetStatus{Length: 2048, Type: "verity", Status: "V -"}
	f.Add(statusReply(512, verity))
	f.Add(statusReply(512, verity, targetStatus{Start: 2048, Length: 1, Type: "error"}))
	f.Add(statusReply(512))
	f.Add(statusReply(headerSize+specSize+4, verity))
	f.Add(statusReply(512, verity)[:headerSize+specSize])
	f.Add(make([]byte, headerSize))
	f.Add([]byte{})
	full := statusReply(512, verity)
	ne.PutUint32(full[offFlags:], unix.DM_BUFFER_FULL_FLAG)
	f.Add(full)
	f.Fuzz(func(t *testing.T, buf []byte) {
		targets, err := parseStatus(buf)
		if err != nil {
			return
		}
		// Each target took a spec and a NUL from the buffer.
		if len(targets)*(specSize+1) > len(buf) {
			t.Fatalf("%d targets from a %d-byte buffer", len(targets), len(buf))
		}
		for _, tg := range targets {
			if len(tg.Type) > maxTypeLen+1 || strings.IndexByte(tg.Status, 0) >= 0 {
				t.Fatalf("bad target %+v", tg)
			}
		}
	})
}
