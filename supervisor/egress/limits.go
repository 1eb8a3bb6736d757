package egress

import (
	"context"
	"sync"
	"time"
)

// bucket is a token bucket of bytes (or of anything) a second. Take goes
// into debt and sleeps it off, so a take larger than the burst still
// passes, at the rate. A zero rate is no limit.
type bucket struct {
	mu     sync.Mutex
	rate   float64 // tokens a second; 0: unlimited
	burst  float64
	tokens float64
	last   time.Time

	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error
}

func newBucket() *bucket {
	return &bucket{now: time.Now, sleep: sleepCtx}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// setRate changes the rate, keeping the tokens already earned (up to the
// new burst). The burst is a quarter second's worth, and at least minBurst.
func (b *bucket) setRate(rate, minBurst float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if rate == b.rate {
		return
	}
	b.refill()
	wasUnlimited := b.rate <= 0
	b.rate = rate
	b.burst = max(rate/4, minBurst)
	b.tokens = min(b.tokens, b.burst)
	if wasUnlimited {
		b.tokens = b.burst
	}
}

// limit is the rate, 0 for none.
func (b *bucket) limit() float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.rate
}

// refill adds what has been earned since last; b.mu is held.
func (b *bucket) refill() {
	now := b.now()
	if !b.last.IsZero() && b.rate > 0 {
		b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	}
	b.last = now
}

// take takes n tokens, sleeping until the bucket has paid for them. It
// returns ctx's error if ctx ends first.
func (b *bucket) take(ctx context.Context, n int) error {
	b.mu.Lock()
	if b.rate <= 0 {
		b.mu.Unlock()
		return nil
	}
	b.refill()
	b.tokens -= float64(n)
	var wait time.Duration
	if b.tokens < 0 {
		wait = time.Duration(-b.tokens / b.rate * float64(time.Second))
	}
	b.mu.Unlock()
	if wait <= 0 {
		return nil
	}
	return b.sleep(ctx, wait)
}
