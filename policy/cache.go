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
type decisionCache struct {
	mu    sync.Mutex
	m     map[string]outcome
	order []string // ring of keys, oldest at next
	next  int
}

func newDecisionCache(n int) *decisionCache {
	return &decisionCache{m: make(map[string]outcome, n), order: make([]string, n)}
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
	if old := c.order[c.next]; old != "" {
		delete(c.m, old)
	}
	c.order[c.next] = key
	c.next = (c.next + 1) % len(c.order)
	c.m[key] = o
}
