package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// quotas holds API keys to their limits (identity.Limits) across calls in
// flight. A call that adds a VM or a snapshot counts what the key's VMs
// hold and what the other calls in flight have reserved, and reserves its
// own, all under one lock; the reservation goes when the call ends. So
// two creates cannot both take a key's last slot, and no lock is held
// while a VM boots. A reservation whose VM (or snapshot) the manager
// already lists is not counted twice.
//
// Restoring a snapshot in place adds nothing: the VM keeps its sizes,
// and the snapshot stays. Snapshots a guest asks for (carrel-agent
// request checkpoint) count, but are not refused here.
type quotas struct {
	mu       sync.Mutex
	reserved map[string][]*reservation // by key name
}

// reservation is a VM, or (isSnapshot) a snapshot of VM vm, in the making.
type reservation struct {
	vm         string
	isSnapshot bool
	snapshot   string
	vm.Footprint
}

// usage is what a key's VMs hold, and calls in flight reserved.
type usage struct {
	vms, snapshots         uint64
	memoryBytes, diskBytes uint64
}

// reserveVM reserves a VM named name of footprint f for the caller in
// ctx, if it is an API key, or refuses it with ResourceExhausted
// (*quotaError) when that would go over one of the key's limits. release
// ends the reservation; the caller calls it once the VM is made, or not.
func (s *vmService) reserveVM(ctx context.Context, name string, f vm.Footprint) (release func(), err error) {
	return s.reserve(ctx, &reservation{vm: name, Footprint: f})
}

// reserveSnapshot is reserveVM for snapshot snap of VM name.
func (s *vmService) reserveSnapshot(ctx context.Context, name, snap string) (release func(), err error) {
	return s.reserve(ctx, &reservation{vm: name, isSnapshot: true, snapshot: snap})
}

func (s *vmService) reserve(ctx context.Context, r *reservation) (func(), error) {
	caller := callerOf(ctx)
	if caller.Type != policy.CallerKey || s.cfg.Tokens == nil {
		return func() {}, nil
	}
	lim, ok := s.cfg.Tokens.LimitsOf(caller.KeyID)
	if !ok {
		return nil, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("key %s was revoked", caller.KeyID))
	}
	if lim == (identity.Limits{}) {
		return func() {}, nil
	}
	q := &s.quotas
	q.mu.Lock()
	defer q.mu.Unlock()
	u, err := q.usage(s.cfg.Manager, caller.Name, lim.Snapshots != 0)
	if err != nil {
		return nil, err
	}
	if err := checkLimits(caller.Name, lim, u, r); err != nil {
		return nil, err
	}
	if q.reserved == nil {
		q.reserved = map[string][]*reservation{}
	}
	q.reserved[caller.Name] = append(q.reserved[caller.Name], r)
	return func() {
		q.mu.Lock()
		defer q.mu.Unlock()
		list := q.reserved[caller.Name]
		for i, x := range list {
			if x == r {
				list = append(list[:i], list[i+1:]...)
				break
			}
		}
		if len(list) == 0 {
			delete(q.reserved, caller.Name)
		} else {
			q.reserved[caller.Name] = list
		}
	}, nil
}

// usage counts what the VMs of key name hold, in every state, and what
// its calls in flight reserved; their snapshots only when snapshots is
// set (it reads each VM's). q.mu is held.
func (q *quotas) usage(m *vm.Manager, name string, snapshots bool) (usage, error) {
	var u usage
	vms := map[string]bool{}
	snaps := map[[2]string]bool{}
	prefix := identity.KeyVMPrefix(name)
	for _, st := range m.List() {
		if !strings.HasPrefix(st.Name, prefix) {
			continue
		}
		vms[st.Name] = true
		f := vm.FootprintOf(st.Record)
		u.vms++
		u.memoryBytes += f.MemoryBytes
		u.diskBytes += f.DiskBytes
		if !snapshots {
			continue
		}
		list, err := m.Snapshots(st.Name)
		if errors.Is(err, vm.ErrNotFound) {
			continue // deleted since it was listed
		}
		if err != nil {
			return usage{}, fmt.Errorf("count the snapshots of %s: %w", st.Name, err)
		}
		for _, sn := range list {
			snaps[[2]string{st.Name, sn.Name}] = true
			u.snapshots++
		}
	}
	for _, r := range q.reserved[name] {
		switch {
		case r.isSnapshot:
			if !snaps[[2]string{r.vm, r.snapshot}] {
				u.snapshots++
			}
		case !vms[r.vm]:
			u.vms++
			u.memoryBytes += r.MemoryBytes
			u.diskBytes += r.DiskBytes
		}
	}
	return u, nil
}

// checkLimits refuses r if it would take key name's VMs over lim.
func checkLimits(name string, lim identity.Limits, u usage, r *reservation) error {
	type check struct {
		limit            string
		max, used, asked uint64
	}
	var checks []check
	if r.isSnapshot {
		checks = []check{{"snapshots", lim.Snapshots, u.snapshots, 1}}
	} else {
		checks = []check{
			{"vms", lim.VMs, u.vms, 1},
			{"memory_bytes", lim.MemoryBytes, u.memoryBytes, r.MemoryBytes},
			{"disk_bytes", lim.DiskBytes, u.diskBytes, r.DiskBytes},
		}
	}
	for _, c := range checks {
		if c.max != 0 && c.used+c.asked > c.max {
			return connect.NewError(connect.CodeResourceExhausted, &quotaError{key: name, Quota: audit.Quota{Limit: c.limit, Max: c.max, Used: c.used, Asked: c.asked}})
		}
	}
	return nil
}

// quotaError is a call refused by a limit of its key's; the call's
// api.call record names the limit (authzInterceptor.ended).
type quotaError struct {
	key string
	audit.Quota
}

func (e *quotaError) Error() string {
	q := e.Quota
	switch q.Limit {
	case "vms":
		return fmt.Sprintf("key %s is at its limit of %d VMs (%d exist, counting stopped ones and creates in flight): delete a VM or ask the operator to raise --max-vms", e.key, q.Max, q.Used)
	case "snapshots":
		return fmt.Sprintf("key %s is at its limit of %d snapshots (its VMs have %d): delete a snapshot, or a VM, or ask the operator to raise --max-snapshots", e.key, q.Max, q.Used)
	case "memory_bytes":
		return fmt.Sprintf("key %s's VMs may have %d MiB of memory together: they have %d MiB, and this VM would add %d MiB: delete a VM, ask for less memory or ask the operator to raise --max-memory", e.key, q.Max>>20, q.Used>>20, q.Asked>>20)
	case "disk_bytes":
		return fmt.Sprintf("key %s's VMs may have %d MiB of disk together (writable layers and workspaces, as created): they have %d MiB, and this VM would add %d MiB: delete a VM, ask for smaller disks or ask the operator to raise --max-disk", e.key, q.Max>>20, q.Used>>20, q.Asked>>20)
	}
	return fmt.Sprintf("key %s is over its limit %s of %d", e.key, q.Limit, q.Max)
}
