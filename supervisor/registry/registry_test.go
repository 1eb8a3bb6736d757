package registry

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/driver"
)

func TestPutGetListDelete(t *testing.T) {
	r, err := Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Truncate(time.Second)
	for _, n := range []string{"web", "demo"} {
		rec := &Record{Name: n, ID: "id-" + n, State: StateRunning, CPUs: 1, MemoryBytes: 512 << 20, CreatedAt: now,
			Instance: &driver.Instance{PID: 42, QMPSocket: "/x/qmp.sock"}}
		if err := r.Put(rec); err != nil {
			t.Fatal(err)
		}
	}
	got, err := r.Get("demo")
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != "id-demo" || got.Instance.PID != 42 || !got.CreatedAt.Equal(now) {
		t.Errorf("round trip: %+v", got)
	}
	list, err := r.List()
	if err != nil || len(list) != 2 || list[0].Name != "demo" || list[1].Name != "web" {
		t.Fatalf("list = %v, %v", list, err)
	}
	if err := r.Delete("demo"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Get("demo"); !errors.Is(err, ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if _, err := os.Stat(r.Dir("demo")); !os.IsNotExist(err) {
		t.Errorf("vm dir left behind: %v", err)
	}
}

func TestCorruptRecordIsAnError(t *testing.T) {
	dir := t.TempDir()
	r, _ := Open(dir)
	if err := r.Put(&Record{Name: "good"}); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(dir, "bad"), 0o700)
	os.WriteFile(filepath.Join(dir, "bad", "vm.json"), []byte("{not json"), 0o600)
	os.MkdirAll(filepath.Join(dir, "empty"), 0o700) // no record: ignored
	list, err := r.List()
	if err == nil || !strings.Contains(err.Error(), "bad") {
		t.Errorf("corrupt record not reported: %v", err)
	}
	if len(list) != 1 || list[0].Name != "good" {
		t.Errorf("list = %v", list)
	}
	os.WriteFile(filepath.Join(dir, "bad", "vm.json"), []byte(`{"name":"other"}`), 0o600)
	if _, err := r.Get("bad"); err == nil {
		t.Error("record naming another vm accepted")
	}
	os.WriteFile(filepath.Join(dir, "bad", "vm.json"), []byte(`{"name":"`+strings.Repeat("x", 2<<20)+`"}`), 0o600)
	if _, err := r.Get("bad"); err == nil {
		t.Error("oversized record accepted")
	}
}
