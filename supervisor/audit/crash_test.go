package audit

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Cut records.log at every byte offset within its last records, as a
// crash mid-write would (with hashes.db and the checkpoints as they
// were): Open keeps every whole record, cuts the rest, ends the intent
// left open, and the log verifies.
func TestCrashCutEveryOffset(t *testing.T) {
	src := t.TempDir()
	l := openLog(t, src, Options{CheckpointEvery: 10, CheckpointInterval: time.Hour})
	ctx := context.Background()
	appendN(t, l, 22)
	p, err := l.Begin(ctx, Record{VM: "demo", Session: "s1", Provenance: Host, Data: json.RawMessage(`{"action":"exec"}`)}) // 22
	if err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 1)                                                                                     // 23
	if _, err := p.End(ctx, Record{Provenance: Host, Data: json.RawMessage(`{"exit":0}`)}); err != nil { // 24
		t.Fatal(err)
	}
	for l.Checkpoint() == nil || l.Checkpoint().Size != 20 {
		time.Sleep(time.Millisecond)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(src, checkpointDir, checkpointName(25))) // the crash came first
	offs, size := frames(t, src)
	orig := readFile(t, filepath.Join(src, recordsFile))
	ends := append(slices.Clone(offs[1:]), size)

	for cut := offs[22]; cut < size; cut++ { // the intent, a record, its outcome
		dir := copyDir(t, src)
		if err := os.Truncate(filepath.Join(dir, recordsFile), cut); err != nil {
			t.Fatal(err)
		}
		var k uint64 // whole frames before the cut
		for k < uint64(len(offs)) && ends[k] <= cut {
			k++
		}
		l, err := Open(dir, Options{Logger: quiet})
		if err != nil {
			t.Fatalf("cut at %d: open: %v", cut, err)
		}
		rc := l.Recovered()
		torn := cut > offs[k]
		if rc.Records != k || torn != (rc.TruncatedBytes > 0) || torn && (rc.TruncatedAt != offs[k] || rc.TruncatedAt+rc.TruncatedBytes != cut) {
			t.Fatalf("cut at %d: kept %d records, want %d; %+v", cut, rc.Records, k, rc)
		}
		wantUnknown := k > 22 && k < 25
		if wantUnknown != slices.Equal(rc.UnknownOutcomes, []uint64{22}) {
			t.Fatalf("cut at %d (%d records): unknown outcomes %v", cut, k, rc.UnknownOutcomes)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		got := readFile(t, filepath.Join(dir, recordsFile))
		if !bytes.Equal(got[:offs[k]], orig[:offs[k]]) {
			t.Fatalf("cut at %d: the kept records changed", cut)
		}
		rep := mustVerify(t, dir)
		if rep.OpenIntents != 0 {
			t.Fatalf("cut at %d: %d open intents", cut, rep.OpenIntents)
		}
	}
	// Below the latest checkpoint, a cut loses acknowledged records:
	// Open says so and cuts nothing.
	dir := copyDir(t, src)
	os.Truncate(filepath.Join(dir, recordsFile), offs[19]+3)
	var lost *LostError
	if _, err := Open(dir, Options{Logger: quiet}); !errorsAs(err, &lost) || lost.Checkpoint != 20 || lost.Records != 19 {
		t.Fatalf("open: %v", err)
	}
	if st, _ := os.Stat(filepath.Join(dir, recordsFile)); st.Size() != offs[19]+3 {
		t.Errorf("open cut a log it refused")
	}
}

const helperEnv = "AUDIT_TEST_HELPER_DIR"

// TestHelperProcess is the child of TestCrashKill: it appends as fast as
// it can and prints each seq once Append has returned it.
func TestHelperProcess(t *testing.T) {
	dir := os.Getenv(helperEnv)
	if dir == "" {
		t.Skip("helper process for TestCrashKill")
	}
	l, err := Open(dir, Options{Logger: quiet, CheckpointEvery: 500})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var mu sync.Mutex
	ack := func(kind string, seq uint64) {
		mu.Lock()
		fmt.Fprintf(os.Stdout, "%s %d\n", kind, seq) // unbuffered: printed means acknowledged
		mu.Unlock()
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				p, err := l.Begin(ctx, Record{VM: "vm", Session: strconv.Itoa(w), Provenance: Host, Data: json.RawMessage(`{"action":"exec"}`)})
				if err != nil {
					os.Exit(3)
				}
				ack(KindIntent, p.Seq())
				s, err := l.Append(ctx, sample(i))
				if err != nil {
					os.Exit(3)
				}
				ack(KindExecStart, s)
				if s, err = p.End(ctx, Record{Provenance: Host, Data: json.RawMessage(`{"exit":0}`)}); err != nil {
					os.Exit(3)
				}
				ack(KindOutcome, s)
			}
		})
	}
	wg.Wait()
}

// kill -9 the writer during heavy writes, three times over the same log:
// every acknowledged record is there, intents in flight end "unknown",
// and the log verifies.
func TestCrashKill(t *testing.T) {
	if testing.Short() {
		t.Skip("re-executes the test binary")
	}
	dir := t.TempDir()
	acked := map[uint64]string{}
	for round := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
		cmd.Env = append(os.Environ(), helperEnv+"="+dir)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lines := make(chan string, 1<<16)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				lines <- sc.Text()
			}
			close(lines)
		}()
		// Kill once it is writing, ~300 ms in.
		first := <-lines
		time.Sleep(300 * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, line := range append([]string{first}, drain(lines)...) {
			kind, seq, ok := strings.Cut(line, " ")
			s, err := strconv.ParseUint(seq, 10, 64)
			if !ok || err != nil {
				continue // the last line may be cut off
			}
			acked[s] = kind
			n++
		}
		cmd.Wait()
		if n < 100 {
			t.Fatalf("round %d: only %d acknowledged records", round, n)
		}

		l, err := Open(dir, Options{Logger: quiet})
		if err != nil {
			t.Fatalf("round %d: open after kill: %v", round, err)
		}
		rc := l.Recovered()
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		kinds := map[uint64]string{}
		Scan(dir, func(seq uint64, _ int64, p []byte) error {
			var h header
			if parseHeader(p, &h) == nil {
				kinds[seq] = string(h.kind)
			}
			return nil
		})
		for s, kind := range acked {
			if kinds[s] != kind {
				t.Fatalf("round %d: acknowledged %s %d, the log has %q there", round, kind, s, kinds[s])
			}
		}
		rep := mustVerify(t, dir)
		if rep.OpenIntents != 0 {
			t.Errorf("round %d: %d intents without an outcome", round, rep.OpenIntents)
		}
		t.Logf("round %d: %d acknowledged, %d records after recovery, %d intents ended unknown, %d bytes of torn tail",
			round, n, rc.Records, len(rc.UnknownOutcomes), rc.TruncatedBytes)
	}
}

func drain(c chan string) []string {
	var out []string
	for s := range c {
		out = append(out, s)
	}
	return out
}
