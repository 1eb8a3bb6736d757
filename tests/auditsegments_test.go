package tests

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestAuditSegments: a carreld whose audit log rolls over every 16 KiB
// runs a session of many commands; the log verifies across its segments,
// and audit show and replay follow the session through more than one.
func TestAuditSegments(t *testing.T) {
	d := harness.New(t, "--audit-segment-size", "16K")
	d.Start()
	d.BuildImage()
	dir := filepath.Join(d.State, "audit")
	d.Must("vm", "create", "seg", "--memory", "256M")
	var vm struct {
		Session string `json:"session"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "seg")), &vm); err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		d.Must("exec", "seg", "--", "echo", fmt.Sprintf("marker-%02d", i))
	}
	d.Must("vm", "stop", "seg")
	d.Stop()

	var rep struct {
		Records  uint64 `json:"records"`
		Segments int    `json:"segments"`
		Problems []any  `json:"problems"`
	}
	v := d.Carrel("audit", "verify", "--dir", dir, "--output", "json")
	if v.Code != 0 || json.Unmarshal([]byte(v.Stdout), &rep) != nil || len(rep.Problems) != 0 || rep.Segments < 3 {
		t.Fatalf("audit verify: %+v", v)
	}
	if text := d.Carrel("audit", "verify", "--dir", dir); text.Code != 0 || !strings.Contains(text.Stdout, fmt.Sprintf("in %d segments", rep.Segments)) {
		t.Errorf("audit verify: %+v", text)
	}

	// The session's records, by seq, and the segment each lies in.
	ents, err := os.ReadDir(filepath.Join(dir, "segments"))
	if err != nil {
		t.Fatal(err)
	}
	var lasts []uint64
	for _, e := range ents {
		var first, last uint64
		if _, err := fmt.Sscanf(e.Name(), "%d-%d.log", &first, &last); err == nil {
			lasts = append(lasts, last)
		}
	}
	segmentOf := func(seq uint64) int {
		for i, last := range lasts {
			if seq <= last {
				return i
			}
		}
		return len(lasts) // records.log
	}
	show := d.Must("audit", "show", vm.Session, "--dir", dir, "--output", "json")
	segs := map[int]bool{}
	sc := bufio.NewScanner(strings.NewReader(show))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec struct{ Seq uint64 }
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("audit show line %q: %v", sc.Text(), err)
		}
		segs[segmentOf(rec.Seq)] = true
	}
	if len(segs) < 2 {
		t.Errorf("audit show: the session's records lie in %d segments, want more than one", len(segs))
	}
	timeline := d.Must("audit", "show", vm.Session, "--dir", dir)
	for _, want := range []string{"marker-00", fmt.Sprintf("marker-%02d", n-1)} {
		if !strings.Contains(timeline, want) {
			t.Errorf("audit show has no %q:\n%s", want, timeline)
		}
	}
	cast := filepath.Join(t.TempDir(), "s.cast")
	d.Must("audit", "replay", vm.Session, "--dir", dir, "--cast", cast)
	b, err := os.ReadFile(cast)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"marker-00", fmt.Sprintf("marker-%02d", n-1)} {
		if !strings.Contains(string(b), want) {
			t.Errorf("the replay has no %q", want)
		}
	}
}
