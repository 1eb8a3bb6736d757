package recorder

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// maxRecordedInput is the largest input document kept whole in a decision
// record; a larger one (a huge argv) is kept as its digest only.
const maxRecordedInput = 32 << 10

// Decision makes a policy decision durable in the audit log before the
// action it admits goes ahead (policystore.Store.Record). It is recorded
// in the session that ctx gives its VM (WithSession). Under Hold it is
// held back for the call's next durable record.
func (rc *Recorder) Decision(ctx context.Context, d policy.Decision, in policy.Input) error {
	data := decisionRecord(d)
	if len(d.Input) <= maxRecordedInput {
		data.Input = d.Input
	}
	b, err := json.Marshal(data)
	if err != nil {
		return err
	}
	rec := audit.Record{Kind: audit.KindPolicyDecision, VM: d.VM, Session: sessionOf(ctx, d.VM), Provenance: audit.Host, Data: b}
	if hold(ctx, rec) {
		return nil // durable with the call's next intent, or its end
	}
	return rc.append(ctx, rec)
}

// decisionRecord is d as its record holds it, without its input.
func decisionRecord(d policy.Decision) audit.Decision {
	return audit.Decision{ID: d.ID, Time: d.Time, Kind: string(d.Kind), VM: d.VM, Policy: d.Policy, Revision: d.Revision,
		InputDigest: d.InputDigest, Allow: d.Allow, Rule: d.Rule, Reason: d.Reason, Cached: d.Cached}
}

// Manifests gives an image's manifest, as stored, by its digest.
type Manifests func(digest string) ([]byte, error)

// Lifecycle records a step in a VM's life, with what a later rerun needs
// to start the same VM: the image digest and the policy revision. The
// records that begin a run (created, starting) also keep the image's
// manifest as a blob, so that a reviewer sees which image, root hash and
// packages the session ran on, offline. A GPU attach or detach gets a
// record of its own kind. manifests may be nil.
func (rc *Recorder) Lifecycle(pols *policystore.Store, manifests Manifests) func(context.Context, vm.Event) error {
	l := rc.log
	return func(ctx context.Context, ev vm.Event) error {
		r := ev.Record
		switch ev.Kind {
		case vm.EventGPUAttach, vm.EventGPUDetach:
			kind := audit.KindGPUAttach
			if ev.Kind == vm.EventGPUDetach {
				kind = audit.KindGPUDetach
			}
			b, err := json.Marshal(audit.GPU{GPUs: r.GPUs, Driver: r.Driver, Reason: ev.Reason})
			if err != nil {
				return err
			}
			return rc.append(ctx, audit.Record{Kind: kind, VM: r.Name, Session: r.Session, Provenance: audit.Host, Data: b})
		}
		data := audit.Lifecycle{Event: string(ev.Kind), ImageDigest: r.ImageDigest, RootHash: r.RootHash, Policy: r.PolicyName(),
			MemoryBytes: r.MemoryBytes, CPUs: r.CPUs, Driver: r.Driver, Reason: ev.Reason, GPUs: r.GPUs}
		if s := ev.Snapshot; s != nil {
			data.Snapshot = &audit.SnapshotRef{VM: s.VM, Name: s.Name, Session: s.Session, StateSHA256: s.State.SHA256, Bytes: s.Bytes(), Guest: s.Guest}
		}
		if o := r.Origin; o != nil {
			data.Origin = &audit.SnapshotRef{VM: o.VM, Name: o.Snapshot, Session: o.Session, Fork: o.Fork}
		}
		var blobs []string
		if manifests != nil && (ev.Kind == vm.EventCreated || ev.Kind == vm.EventStarting) {
			name, blob, err := keepManifest(l, manifests, r.ImageDigest)
			if err != nil {
				return err
			}
			data.ImageName, blobs = name, []string{blob}
		}
		if p, err := pols.Get(r.PolicyName()); err == nil {
			data.PolicyRevision = p.Revision
		}
		if len(data.Reason) > 4096 {
			data.Reason = data.Reason[:4096]
		}
		b, err := json.Marshal(data)
		if err != nil {
			return err
		}
		return rc.append(ctx, audit.Record{Kind: audit.KindVMLifecycle, VM: r.Name, Session: r.Session, Provenance: audit.Host, Data: b, Blobs: blobs})
	}
}

// keepManifest puts the image's manifest in the audit log's blob store
// (content-addressed, so its digest is the image's) and returns the
// image's name and the blob's digest.
func keepManifest(l Log, manifests Manifests, digest string) (string, string, error) {
	b, err := manifests(digest)
	if err != nil {
		return "", "", fmt.Errorf("image manifest for the audit log: %w", err)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		return "", "", fmt.Errorf("image manifest for the audit log: %w", err)
	}
	blob, err := l.PutBlob(bytes.NewReader(b))
	if err != nil {
		return "", "", err
	}
	if blob != digest {
		return "", "", fmt.Errorf("image manifest for the audit log: stored as %s, not %s", blob, digest)
	}
	return m.Name, blob, nil
}
