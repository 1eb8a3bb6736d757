package audit

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// faults decides what the files of a log under test do wrong.
type faults struct {
	mu      sync.Mutex
	file    string // base name of the file that fails
	write   error  // Write fails (after writing half, if partial)
	partial bool
	sync    error // Sync fails
	trunc   error // Truncate fails
	openErr error // opening a file of that name fails
}

func (f *faults) set(file string, write, sync, trunc error, partial bool) {
	f.mu.Lock()
	f.file, f.write, f.sync, f.trunc, f.partial = file, write, sync, trunc, partial
	f.mu.Unlock()
}

func (f *faults) get(name string) (write, sync, trunc error, partial bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if filepath.Base(name) != f.file {
		return nil, nil, nil, false
	}
	return f.write, f.sync, f.trunc, f.partial
}

func (f *faults) open(name string) (file, error) {
	f.mu.Lock()
	err := f.openErr
	if filepath.Base(name) != f.file {
		err = nil
	}
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	fl, err := openAppend(name)
	if err != nil {
		return nil, err
	}
	return &faultyFile{file: fl, name: name, f: f}, nil
}

type faultyFile struct {
	file
	name string
	f    *faults
}

func (ff *faultyFile) Write(p []byte) (int, error) {
	if err, _, _, partial := ff.f.get(ff.name); err != nil {
		if partial {
			n, _ := ff.file.Write(p[:len(p)/2])
			return n, err
		}
		return 0, err
	}
	return ff.file.Write(p)
}

func (ff *faultyFile) Sync() error {
	if _, err, _, _ := ff.f.get(ff.name); err != nil {
		return err
	}
	return ff.file.Sync()
}

func (ff *faultyFile) Truncate(n int64) error {
	if _, _, err, _ := ff.f.get(ff.name); err != nil {
		return err
	}
	return ff.file.Truncate(n)
}

// events records OnFault and OnRecover calls.
type events struct {
	fault   chan error
	recover chan struct{}
}

func newEvents(opts *Options) *events {
	e := &events{fault: make(chan error, 16), recover: make(chan struct{}, 16)}
	opts.OnFault = func(err error) { e.fault <- err }
	opts.OnRecover = func() { e.recover <- struct{}{} }
	return e
}

func (e *events) waitFault(t *testing.T) error {
	t.Helper()
	select {
	case err := <-e.fault:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("no OnFault")
		return nil
	}
}

func (e *events) waitRecover(t *testing.T) {
	t.Helper()
	select {
	case <-e.recover:
	case <-time.After(5 * time.Second):
		t.Fatal("no OnRecover")
	}
}

// faultyLog opens a log in a new directory whose files fail as f is set,
// retrying every 5 ms, with its fault and recovery events in ev.
func faultyLog(t *testing.T) (dir string, f *faults, ev *events, l *Log) {
	dir, f = t.TempDir(), &faults{}
	opts := Options{open: f.open, RetryInterval: 5 * time.Millisecond}
	ev = newEvents(&opts)
	return dir, f, ev, openLog(t, dir, opts)
}

func TestFaultRecordsFile(t *testing.T) {
	for name, tc := range map[string]struct {
		write, sync, trunc error
		partial            bool
		want               error
	}{
		"ENOSPC on write, half written":      {write: syscall.ENOSPC, partial: true, want: syscall.ENOSPC},
		"EIO on fsync":                       {sync: syscall.EIO, want: syscall.EIO},
		"EIO on write and on truncate":       {write: syscall.EIO, trunc: syscall.EIO, partial: true, want: syscall.EIO},
		"ENOSPC on write, nothing written":   {write: syscall.ENOSPC, want: syscall.ENOSPC},
		"EIO on fsync and truncate, then ok": {sync: syscall.EIO, trunc: syscall.EIO, want: syscall.EIO},
	} {
		t.Run(name, func(t *testing.T) {
			dir, f, ev, l := faultyLog(t)
			ctx := context.Background()
			appendN(t, l, 10)
			_, size := frames(t, dir)

			f.set(recordsFile, tc.write, tc.sync, tc.trunc, tc.partial)
			_, err := l.Append(ctx, sample(10))
			if !errors.Is(err, ErrUnavailable) || !errors.Is(err, tc.want) {
				t.Fatalf("append during the fault: %v", err)
			}
			if ferr := ev.waitFault(t); !errors.Is(ferr, ErrUnavailable) || !errors.Is(ferr, tc.want) {
				t.Errorf("OnFault: %v", ferr)
			}
			if err := l.Health(); !errors.Is(err, ErrUnavailable) || !errors.Is(err, tc.want) {
				t.Errorf("Health: %v", err)
			}
			// Fail fast while the fault lasts, with the probe failing too.
			for range 5 {
				start := time.Now()
				if _, err := l.Begin(ctx, Record{Provenance: Host}); !errors.Is(err, ErrUnavailable) {
					t.Fatalf("append while unavailable: %v", err)
				}
				if d := time.Since(start); d > 100*time.Millisecond {
					t.Errorf("refusal took %v", d)
				}
				time.Sleep(10 * time.Millisecond)
			}
			if tc.trunc == nil {
				// Nothing partial stays behind (a failing probe may be
				// between its write and its truncate at any moment).
				var got int64
				for range 100 {
					st, _ := os.Stat(filepath.Join(dir, recordsFile))
					if got = st.Size(); got == size {
						break
					}
					time.Sleep(time.Millisecond)
				}
				if got != size {
					t.Errorf("records.log is %d bytes during the fault, want %d", got, size)
				}
			}
			select {
			case <-ev.recover:
				t.Fatal("recovered while the disk still fails")
			default:
			}

			f.set("", nil, nil, nil, false)
			ev.waitRecover(t)
			if err := l.Health(); err != nil {
				t.Errorf("Health after recovery: %v", err)
			}
			s, err := l.Append(ctx, sample(11))
			if err != nil || s != 11 {
				t.Fatalf("append after recovery: seq %d, %v", s, err)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			mustVerify(t, dir)
			// Record 10 is the probe's: how long and how many refused.
			var rec Record
			Scan(dir, func(seq uint64, _ int64, p []byte) error {
				if seq == 10 {
					rec, err = Decode(p)
				}
				return err
			})
			var d RecoveryData
			json.Unmarshal(rec.Data, &d)
			if rec.Kind != KindRecovery || d.Cause != "fault" || d.Refused < 5 || !strings.Contains(d.Error, tc.want.Error()) || d.Since == nil {
				t.Errorf("recovery record %+v %+v", rec, d)
			}
		})
	}
}

// ckptFaults fails checkpoint writes with err while it is set.
type ckptFaults struct {
	mu  sync.Mutex
	err error
}

func (c *ckptFaults) set(err error) {
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
}

func (c *ckptFaults) writeFile(p string, b []byte, m os.FileMode) error {
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(p, b, m)
}

// A hashes.db or checkpoint failure also turns the log unavailable; the
// batch already durable stays acknowledged.
func TestFaultHashesAndCheckpoint(t *testing.T) {
	dir := t.TempDir()
	f := &faults{}
	var ckpt ckptFaults
	opts := Options{open: f.open, RetryInterval: 5 * time.Millisecond, CheckpointEvery: 5,
		writeFile: ckpt.writeFile}
	ev := newEvents(&opts)
	l := openLog(t, dir, opts)
	ctx := context.Background()
	appendN(t, l, 3)

	// Stored hashes are written when a checkpoint needs them: the fifth
	// record's.
	f.set(hashesFile, syscall.EIO, nil, nil, true)
	for i := uint64(3); i < 5; i++ {
		if s, err := l.Append(ctx, sample(int(i))); err != nil || s != i {
			t.Fatalf("the batch is durable before hashes.db fails: %d %v", s, err)
		}
	}
	if err := ev.waitFault(t); !errors.Is(err, syscall.EIO) {
		t.Errorf("OnFault: %v", err)
	}
	if _, err := l.Append(ctx, sample(5)); !errors.Is(err, ErrUnavailable) {
		t.Errorf("append: %v", err)
	}
	f.set("", nil, nil, nil, false)
	ev.waitRecover(t)

	ckpt.set(syscall.ENOSPC)
	// Append until the checkpoint due at CheckpointEvery fails.
	for i := 0; ; i++ {
		if _, err := l.Append(ctx, sample(i)); err != nil {
			if !errors.Is(err, ErrUnavailable) {
				t.Fatal(err)
			}
			break
		}
		if i > 100 {
			t.Fatal("no fault from the checkpoint")
		}
	}
	if err := ev.waitFault(t); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("OnFault: %v", err)
	}
	ckpt.set(nil)
	ev.waitRecover(t)
	if cp := l.Checkpoint(); cp == nil || cp.Size < 5 {
		t.Errorf("checkpoint after recovery: %+v", cp)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := mustVerify(t, dir); rep.Latest != rep.Records {
		t.Errorf("last checkpoint %d of %d records", rep.Latest, rep.Records)
	}
	// hashes.db is whole: proofs work after a reopen.
	l = openLog(t, dir, Options{})
	defer l.Close()
	if rc := l.Recovered(); rc.HashesFrom != rc.Checkpoint {
		t.Errorf("hashes rebuilt from %d", rc.HashesFrom)
	}
}

// A real full disk: a 1 MiB tmpfs (needs root).
func TestFaultRealENOSPC(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small tmpfs")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
	filler := filepath.Join(dir, "filler")
	if err := os.WriteFile(filler, make([]byte, 700<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	logDir := filepath.Join(dir, "audit")
	opts := Options{RetryInterval: 5 * time.Millisecond, CheckpointEvery: 50}
	ev := newEvents(&opts)
	l := openLog(t, logDir, opts)
	t.Cleanup(func() { l.Close() }) // before the unmount, if the test stops early
	ctx := context.Background()
	var acked []uint64
	var err error
	for i := 0; ; i++ {
		var s uint64
		if s, err = l.Append(ctx, sample(i)); err != nil {
			break
		}
		acked = append(acked, s)
		if i > 10000 {
			t.Fatal("the disk never filled")
		}
	}
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("append on a full disk: %v", err)
	}
	ev.waitFault(t)
	if _, err := l.Append(ctx, sample(0)); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append on a full disk: %v", err)
	}
	os.Remove(filler)
	ev.waitRecover(t)
	if _, err := l.Append(ctx, sample(0)); err != nil {
		t.Fatalf("append after space came back: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rep := mustVerify(t, logDir)
	if rep.Records < uint64(len(acked))+2 {
		t.Errorf("%d records, %d acknowledged before the disk filled", rep.Records, len(acked))
	}
	t.Logf("%d records fit before ENOSPC", len(acked))
}

// A checkpoint that fails after the last append, while the committer
// waits for more, still starts the probe: the log recovers with no
// further appends.
func TestFaultCheckpointWhileIdle(t *testing.T) {
	dir := t.TempDir()
	var ckpt ckptFaults
	opts := Options{RetryInterval: 5 * time.Millisecond, CheckpointEvery: 5,
		writeFile: ckpt.writeFile}
	ev := newEvents(&opts)
	l := openLog(t, dir, opts)
	defer l.Close()
	ckpt.set(syscall.ENOSPC)
	appendN(t, l, 5)
	if err := ev.waitFault(t); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("OnFault: %v", err)
	}
	ckpt.set(nil)
	ev.waitRecover(t)
	if cp := l.Checkpoint(); cp == nil || cp.Size < 5 {
		t.Errorf("checkpoint after recovery: %+v", cp)
	}
}

// TestFaultKeepsOutcomes: an outcome that comes while the log is
// unavailable (its append refused, or in the batch that failed) is
// written once the log is available again, right after the
// audit.recovery record, once; its intent is not left open, and the End
// that failed is not to be retried.
func TestFaultKeepsOutcomes(t *testing.T) {
	dir, f, ev, l := faultyLog(t)
	ctx := context.Background()
	failing, err := l.Begin(ctx, Record{Provenance: Host})
	if err != nil {
		t.Fatal(err)
	}
	refused, err := l.Begin(ctx, Record{Provenance: Host})
	if err != nil {
		t.Fatal(err)
	}
	never, err := l.Begin(ctx, Record{Provenance: Host}) // ends after the log is back
	if err != nil {
		t.Fatal(err)
	}

	f.set(recordsFile, syscall.ENOSPC, nil, nil, false)
	if _, err := failing.End(ctx, Record{Provenance: Host, Data: []byte(`{"n":1}`)}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("End in the batch that fails: %v", err)
	}
	ev.waitFault(t)
	if _, err := refused.End(ctx, Record{Provenance: Host, Data: []byte(`{"n":2}`)}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("End while unavailable: %v", err)
	}
	if _, err := refused.End(ctx, Record{Provenance: Host}); !errors.Is(err, ErrEnded) {
		t.Fatalf("a second End of a kept outcome: %v; want ErrEnded", err)
	}
	f.set("", nil, nil, nil, false)
	ev.waitRecover(t)
	if _, err := never.End(ctx, Record{Provenance: Host}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	rep := mustVerify(t, dir)
	if rep.OpenIntents != 0 {
		t.Errorf("%d intents left open", rep.OpenIntents)
	}
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var kinds []string
	outcomes := map[uint64]int{}
	if _, err := r.Scan(func(seq uint64, _ int64, payload []byte) error {
		rec, err := Decode(payload)
		if err != nil {
			return err
		}
		kinds = append(kinds, rec.Kind)
		if rec.Intent != nil {
			outcomes[*rec.Intent]++
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := []string{KindIntent, KindIntent, KindIntent, KindRecovery, KindOutcome, KindOutcome, KindOutcome}
	if !slices.Equal(kinds, want) {
		t.Errorf("records %v, want %v", kinds, want)
	}
	for _, p := range []*Pending{failing, refused, never} {
		if outcomes[p.Seq()] != 1 {
			t.Errorf("intent %d has %d outcomes", p.Seq(), outcomes[p.Seq()])
		}
	}
}
