package policystore

import (
	"sync"

	"github.com/carrel-os/carrel/policy"
)

// decisionLogSize is how many recent decisions carreld keeps in memory for
// `carrel policy decisions`; the audit log keeps all of them.
const decisionLogSize = 4096

// ring is a bounded, concurrent log of decisions. It grows as decisions
// come, up to its bound, and keeps each without its input JSON, which
// the audit log holds and a listing never shows: a busy VM's inputs
// (command lines, paths) would otherwise stay in carreld's memory.
type ring struct {
	mu   sync.Mutex
	size int
	buf  []policy.Decision // once size long, a ring with the oldest at next
	next int
	full bool
}

func newRing(n int) *ring { return &ring{size: n} }

func (r *ring) add(d policy.Decision) {
	d.Input = nil
	r.mu.Lock()
	if len(r.buf) < r.size {
		r.buf = append(r.buf, d)
	} else {
		r.buf[r.next] = d
	}
	r.next++
	if r.next == r.size {
		r.next, r.full = 0, true
	}
	r.mu.Unlock()
}

// filter returns the newest limit entries that match, oldest first.
func (r *ring) filter(match func(*policy.Decision) bool, limit int) []policy.Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []policy.Decision
	n := r.next
	if r.full {
		n = len(r.buf)
	}
	for i := 0; i < n && len(out) < limit; i++ {
		idx := (r.next - 1 - i + len(r.buf)) % len(r.buf)
		if match(&r.buf[idx]) {
			out = append(out, r.buf[idx])
		}
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out
}
