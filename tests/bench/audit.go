package main

// The audit log (supervisor/audit): sustained durable appends with group
// commit against the baseline the issue names, an fdatasync after every
// record (the same frames and JSON, a mutex around write+fdatasync), both
// from the same writers on the same disk, alternating round by round; the
// latency one Append adds to an action under moderate load; and Verify's
// speed over a million records, against the straightforward way
// (encoding/json per record, tlog.StoredHashes per record into memory).
// The logs live on a disk-backed filesystem: fdatasync on tmpfs is free
// and would make the numbers meaningless.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/mod/sumdb/tlog"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/supervisor/audit"
)

const (
	auditRounds         = 5
	auditRoundTime      = 1500 * time.Millisecond // per side and round, throughput
	auditWriters        = 64
	auditLatencyWriters = 8
	auditLatencyTime    = time.Second
	auditVerifyRecords  = 1_000_000
	auditVerifyRounds   = 3
	// Targets.
	auditTargetRate   = 100_000 // durable records/s
	auditTargetP99    = 2 * time.Millisecond
	auditTargetVerify = 1_000_000 // records/s
)

// auditRecord is a typical record: an exec with its argv, env and cwd,
// about 300 bytes as JSON.
func auditRecord(i int) audit.Record {
	return audit.Record{
		Kind: audit.KindExecStart, VM: "bench", Session: "s-0123456789abcdef", Provenance: audit.Host,
		Data: json.RawMessage(fmt.Sprintf(`{"argv":["go","test","./..."],"env":{"HOME":"/workspace","GOFLAGS":"-mod=mod"},"cwd":"/workspace/src","user":"agent","pid":%d}`, 4000+i%1000)),
	}
}

// fsyncPerRecord is the baseline: each Append writes one frame and
// fdatasyncs before the next may start.
type fsyncPerRecord struct {
	mu  sync.Mutex
	f   *os.File
	seq uint64
	buf []byte
}

func newFsyncPerRecord(dir string) (*fsyncPerRecord, error) {
	f, err := os.OpenFile(filepath.Join(dir, "records.log"), os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	return &fsyncPerRecord{f: f}, nil
}

var crc32c = crc32.MakeTable(crc32.Castagnoli)

func (b *fsyncPerRecord) Append(rec audit.Record) (uint64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	rec.Seq, rec.Time = b.seq, time.Now().UTC()
	p, err := json.Marshal(rec) // the same bytes the log writes
	if err != nil {
		return 0, err
	}
	b.buf = append(b.buf[:0], make([]byte, 8)...)
	b.buf = append(b.buf, p...)
	binary.LittleEndian.PutUint32(b.buf[0:], uint32(len(p)))
	binary.LittleEndian.PutUint32(b.buf[4:], crc32.Checksum(p, crc32c))
	if _, err := b.f.Write(b.buf); err != nil {
		return 0, err
	}
	if err := unix.Fdatasync(int(b.f.Fd())); err != nil {
		return 0, err
	}
	b.seq++
	return b.seq - 1, nil
}

// auditDir is where the logs go: /var/tmp, or the working directory if
// /var/tmp is a tmpfs. It returns the filesystem's name too.
func auditDir() (string, string, error) {
	for _, parent := range []string{"/var/tmp", "."} {
		var st unix.Statfs_t
		if err := unix.Statfs(parent, &st); err != nil {
			continue
		}
		if fs := fsName(st.Type); fs != "tmpfs" && fs != "ramfs" {
			dir, err := os.MkdirTemp(parent, "carrel-audit-bench-")
			if err != nil {
				return "", "", err
			}
			dir, _ = filepath.Abs(dir)
			return dir, fs, nil
		}
	}
	return "", "", fmt.Errorf("no disk-backed directory: /var/tmp and . are tmpfs")
}

func fsName(magic int64) string {
	switch magic {
	case 0xef53:
		return "ext4"
	case 0x58465342:
		return "xfs"
	case 0x9123683e:
		return "btrfs"
	case 0x01021994:
		return "tmpfs"
	case 0x858458f6:
		return "ramfs"
	case 0x794c7630:
		return "overlayfs"
	case 0x2fc12fc1:
		return "zfs"
	}
	return fmt.Sprintf("filesystem 0x%x", magic)
}

// appendFor runs writers that append for d and returns the records
// acknowledged and each Append's latency.
func appendFor(writers int, d time.Duration, appendOne func(int) error) (int64, []time.Duration, error) {
	var n atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	var firstErr error
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			var mine []time.Duration
			for i := 0; time.Now().Before(deadline); i++ {
				t0 := time.Now()
				if err := appendOne(w*1_000_000 + i); err != nil {
					mu.Lock()
					firstErr = err
					mu.Unlock()
					return
				}
				mine = append(mine, time.Since(t0))
				n.Add(1)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	return n.Load(), lat, firstErr
}

// auditSide runs one round of one side in a fresh directory.
func auditSide(root string, group bool, writers int, d time.Duration) (rate float64, lat []time.Duration, err error) {
	dir, err := os.MkdirTemp(root, "round-")
	if err != nil {
		return 0, nil, err
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()
	var appendOne func(int) error
	var closeFn func() error
	if group {
		l, err := audit.Open(dir, audit.Options{})
		if err != nil {
			return 0, nil, err
		}
		appendOne = func(i int) error { _, err := l.Append(ctx, auditRecord(i)); return err }
		closeFn = l.Close
	} else {
		b, err := newFsyncPerRecord(dir)
		if err != nil {
			return 0, nil, err
		}
		appendOne = func(i int) error { _, err := b.Append(auditRecord(i)); return err }
		closeFn = b.f.Close
	}
	start := time.Now()
	n, lat, err := appendFor(writers, d, appendOne)
	el := time.Since(start)
	if cerr := closeFn(); err == nil {
		err = cerr
	}
	return float64(n) / el.Seconds(), lat, err
}

func benchAudit() error {
	root, fs, err := auditDir()
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	fmt.Printf("\naudit log on %s (%s), %d CPUs: durable appends with group commit against an fdatasync per record (same frames and JSON, a mutex around write+fdatasync), %d writers, %d rounds of %v per side, alternating:\n",
		fs, root, runtime.NumCPU(), auditWriters, auditRounds, auditRoundTime)
	var ours, base []float64
	for r := range auditRounds {
		o, _, err := auditSide(root, true, auditWriters, auditRoundTime)
		if err != nil {
			return fmt.Errorf("group commit: %w", err)
		}
		b, _, err := auditSide(root, false, auditWriters, auditRoundTime)
		if err != nil {
			return fmt.Errorf("fsync per record: %w", err)
		}
		ours, base = append(ours, o), append(base, b)
		fmt.Printf("  round %d: group commit %.0f records/s, fsync per record %.0f records/s\n", r+1, o, b)
	}
	mo, mb := medianFloat(ours), medianFloat(base)
	fmt.Printf("append throughput median: group commit %.0f durable records/s, fsync per record %.0f, ratio %.1fx; target >= %d records/s: %s\n",
		mo, mb, mo/mb, auditTargetRate, verdict(mo >= auditTargetRate))

	fmt.Printf("\naudit append latency, %d writers appending back to back, %d rounds of %v per side, alternating:\n", auditLatencyWriters, auditRounds, auditLatencyTime)
	var lo, lb []time.Duration
	for range auditRounds {
		_, l, err := auditSide(root, true, auditLatencyWriters, auditLatencyTime)
		if err != nil {
			return fmt.Errorf("group commit: %w", err)
		}
		lo = append(lo, l...)
		_, l, err = auditSide(root, false, auditLatencyWriters, auditLatencyTime)
		if err != nil {
			return fmt.Errorf("fsync per record: %w", err)
		}
		lb = append(lb, l...)
	}
	o50, o99 := percentile(lo, 50), percentile(lo, 99)
	fmt.Printf("  group commit:     p50 %v p99 %v (%d appends)\n", fmtDur(o50), fmtDur(o99), len(lo))
	fmt.Printf("  fsync per record: p50 %v p99 %v (%d appends)\n", fmtDur(percentile(lb, 50)), fmtDur(percentile(lb, 99)), len(lb))
	fmt.Printf("append latency added to an action: p50 %v, p99 %v; target p99 <= %v: %s\n", fmtDur(o50), fmtDur(o99), auditTargetP99, verdict(o99 <= auditTargetP99))

	return benchAuditVerify(root)
}

func benchAuditVerify(root string) error {
	dir := filepath.Join(root, "verify")
	l, err := audit.Open(dir, audit.Options{})
	if err != nil {
		return err
	}
	ctx := context.Background()
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Value
	for range 4 * auditWriters {
		wg.Go(func() {
			for i := next.Add(1); i <= auditVerifyRecords; i = next.Add(1) {
				if _, err := l.Append(ctx, auditRecord(int(i))); err != nil {
					firstErr.Store(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := l.Close(); err != nil {
		return err
	}
	if err, _ := firstErr.Load().(error); err != nil {
		return err
	}
	written := time.Since(start)
	first, err := audit.Verify(dir, audit.VerifyOptions{SkipBlobs: true})
	if err != nil {
		return err
	}
	fmt.Printf("\naudit verification of %d records (%.0f MiB in %d segments, written by %d writers in %v), %d rounds, alternating with the straightforward way (encoding/json and tlog.StoredHashes per record):\n",
		auditVerifyRecords, float64(first.Bytes)/(1<<20), first.Segments, 4*auditWriters, written.Round(time.Millisecond), auditVerifyRounds)
	var ours, base []float64
	for r := range auditVerifyRounds {
		t0 := time.Now()
		rep, err := audit.Verify(dir, audit.VerifyOptions{})
		if err != nil {
			return err
		}
		o := float64(rep.Records) / time.Since(t0).Seconds()
		// Each segment after the first opens with its audit.segment record.
		if !rep.OK() || rep.Records != auditVerifyRecords+uint64(rep.Segments-1) {
			return fmt.Errorf("verify: %d records, problems %v", rep.Records, rep.Problems)
		}
		t0 = time.Now()
		n, rootHash, err := naiveVerify(dir)
		if err != nil {
			return err
		}
		b := float64(n) / time.Since(t0).Seconds()
		if rootHash != rep.Root {
			return fmt.Errorf("the two verifications disagree on the root: %v, %v", rep.Root, rootHash)
		}
		ours, base = append(ours, o), append(base, b)
		fmt.Printf("  round %d: Verify %.0f records/s (%d checkpoints), straightforward %.0f records/s\n", r+1, o, rep.Checkpoints, b)
	}
	mo, mb := medianFloat(ours), medianFloat(base)
	fmt.Printf("verification median: %.0f records/s, straightforward %.0f, ratio %.1fx; target >= %d records/s: %s\n",
		mo, mb, mo/mb, auditTargetVerify, verdict(mo >= auditTargetVerify))
	return nil
}

// naiveVerify is the straightforward way: decode every record, check its
// seq, and grow the tree with tlog.StoredHashes, hashes kept in memory.
func naiveVerify(dir string) (int64, tlog.Hash, error) {
	var stored []tlog.Hash
	r := tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
		out := make([]tlog.Hash, len(idx))
		for i, x := range idx {
			out[i] = stored[x]
		}
		return out, nil
	})
	var n int64
	err := audit.Scan(dir, func(seq uint64, _ int64, p []byte) error {
		var rec audit.Record
		if err := json.Unmarshal(p, &rec); err != nil {
			return err
		}
		if rec.Seq != seq {
			return fmt.Errorf("record %d says seq %d", seq, rec.Seq)
		}
		hs, err := tlog.StoredHashes(n, p, r)
		if err != nil {
			return err
		}
		stored = append(stored, hs...)
		n++
		return nil
	})
	if err != nil {
		return 0, tlog.Hash{}, err
	}
	h, err := tlog.TreeHash(n, r)
	return n, h, err
}
