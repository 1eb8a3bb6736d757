package audit

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fillLog appends n sample records from 256 writers.
func fillLog(b testing.TB, dir string, n int) time.Duration {
	l := openLog(b, dir, Options{})
	var wg sync.WaitGroup
	var next atomic.Int64
	start := time.Now()
	for range 256 {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				if _, err := l.Append(context.Background(), sample(int(i))); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	d := time.Since(start)
	if err := l.Close(); err != nil {
		b.Fatal(err)
	}
	return d
}

// BenchmarkVerify: AUDIT_BENCH_RECORDS records (default 200,000), in
// /var/tmp (not a tmpfs, usually).
func BenchmarkVerify(b *testing.B) {
	dir, err := os.MkdirTemp("/var/tmp", "audit-bench-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	n := 200_000
	if os.Getenv("AUDIT_BENCH_RECORDS") == "1m" {
		n = 1_000_000
	}
	d := fillLog(b, dir, n)
	b.Logf("append: %.0f records/s", float64(n)/d.Seconds())
	b.ResetTimer()
	for b.Loop() {
		rep, err := Verify(dir, VerifyOptions{})
		if err != nil || !rep.OK() {
			b.Fatal(err, rep.Problems)
		}
	}
	b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "records/s")
}
