package policy

import "sync"

// decisionCacheSize bounds each policy's decision cache.
const decisionCacheSize = 8192

// outcome is what a decision cache keeps: the evaluation's result, not
// the decision's id or time, which are new for every decision.
type outcome struct {
	allow        bool
	rule, reason string
}

// decisionCache remembers outcomes by kind and input digest. It is sound
// because a compiled policy never changes (a new revision is a new
// Policy, with an empty cache) and bundles may use only deterministic
// builtins, so the same input always gets the same outcome. When full it
// forgets its oldest entry.
//
// It starts empty and grows with use: carreld compiles every built-in
// policy at start, and a cache sized for its bound up front (about 1 MiB)
// would cost that much per policy whether or not any VM uses it.
type decisionCache struct {
	mu    sync.Mutex
	max   int
	m     map[string]outcome
	order []string // keys as put; once max long, a ring with the oldest at next
	next  int
}

func newDecisionCache(max int) *decisionCache {
	return &decisionCache{max: max, m: map[string]outcome{}}
}

func (c *decisionCache) get(key string) (outcome, bool) {
	c.mu.Lock()
	o, ok := c.m[key]
	c.mu.Unlock()
	return o, ok
}

func (c *decisionCache) put(key string, o outcome) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[key]; ok {
		return
	}
	if len(c.order) < c.max {
		c.order = append(c.order, key)
	} else {
		delete(c.m, c.order[c.next])
		c.order[c.next] = key
		c.next = (c.next + 1) % c.max
	}
	c.m[key] = o
}
