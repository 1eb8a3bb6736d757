// Package clocktest is a clock for tests that moves only when told: a
// stand-in for time.Now where code takes its clock as a func() time.Time.
package clocktest

import (
	"sync"
	"time"
)

// Clock is safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// New returns a clock that reads t until advanced.
func New(t time.Time) *Clock { return &Clock{t: t} }

// Now is the clock's time; pass c.Now where a func() time.Time is wanted.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}
