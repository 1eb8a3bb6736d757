package libvirt

import (
	"context"
	"fmt"
	"sync"

	lv "github.com/digitalocean/go-libvirt"
)

// libvirtd lets a connection register a callback for an event only once
// ("event callback already tracked"), and carreld may wait on the same
// domain twice at a time (its exit watcher and a stop). So the driver
// holds one lifecycle subscription per connection and fans its events out
// to every Wait by domain UUID.

// subscription is one registration for lifecycle events.
type subscription struct {
	done chan struct{} // closed when the stream ends (connection lost)

	mu      sync.Mutex
	waiters map[lv.UUID]map[chan struct{}]bool
}

func newSubscription(events <-chan lv.DomainEventLifecycleMsg) *subscription {
	s := &subscription{done: make(chan struct{}), waiters: map[lv.UUID]map[chan struct{}]bool{}}
	go s.run(events)
	return s
}

// run reads events until the stream closes. It must keep reading:
// go-libvirt's stream blocks on each send.
func (s *subscription) run(events <-chan lv.DomainEventLifecycleMsg) {
	for ev := range events {
		switch lv.DomainEventType(ev.Event) {
		case lv.DomainEventStopped, lv.DomainEventUndefined:
			s.fire(ev.Dom.UUID)
		}
	}
	close(s.done)
}

func (s *subscription) fire(u lv.UUID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.waiters[u] {
		close(ch)
	}
	delete(s.waiters, u)
}

// watch returns a channel closed when the domain with UUID u stops, and
// a func to stop watching.
func (s *subscription) watch(u lv.UUID) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	s.mu.Lock()
	if s.waiters[u] == nil {
		s.waiters[u] = map[chan struct{}]bool{}
	}
	s.waiters[u][ch] = true
	s.mu.Unlock()
	return ch, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if set := s.waiters[u]; set[ch] {
			delete(set, ch)
			if len(set) == 0 {
				delete(s.waiters, u)
			}
		}
	}
}

func (s *subscription) live() bool {
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// subscription returns the live subscription, registering one if there is
// none. One registration is in flight at a time; it runs on, bounded by
// rpcTimeout, when ctx gives up on it, so that a late success is still
// the one subscription and not a stray registration in libvirtd's way.
func (d *Driver) subscription(ctx context.Context) (*subscription, error) {
	for {
		d.subMu.Lock()
		if d.sub != nil && d.sub.live() {
			s := d.sub
			d.subMu.Unlock()
			return s, nil
		}
		if d.pending == nil {
			d.pending = make(chan struct{})
			go d.register(d.pending)
		}
		p := d.pending
		d.subMu.Unlock()
		select {
		case <-p:
		case <-ctx.Done():
			return nil, fmt.Errorf("subscribe to libvirt events: %w", ctx.Err())
		}
		d.subMu.Lock()
		s, err := d.sub, d.subErr
		d.subMu.Unlock()
		if s == nil || !s.live() {
			if err == nil {
				err = fmt.Errorf("libvirt event stream closed at once")
			}
			return nil, err
		}
	}
}

func (d *Driver) register(pending chan struct{}) {
	err := d.do(context.Background(), "subscribe to libvirt events", func(c *lv.Libvirt) error {
		events, err := c.LifecycleEvents(context.Background())
		if err != nil {
			return err
		}
		// Installed here, not by the caller: a success that comes after
		// do gave up must still be the subscription.
		s := newSubscription(events)
		d.subMu.Lock()
		d.sub = s
		d.subMu.Unlock()
		return nil
	})
	d.subMu.Lock()
	d.subErr = err
	d.pending = nil
	d.subMu.Unlock()
	close(pending)
}
