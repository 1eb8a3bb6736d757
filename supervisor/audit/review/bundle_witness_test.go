package review

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/witness"
)

// testWitness is a witness's signer and its verifier key.
type testWitness struct {
	signer   *witness.Signer
	verifier note.Verifier
}

func newTestWitness(t *testing.T, name string) testWitness {
	t.Helper()
	skey, vkey, err := witness.GenerateKey(name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := witness.NewSigner(skey)
	if err != nil {
		t.Fatal(err)
	}
	v, err := witness.NewVerifier(vkey)
	if err != nil {
		t.Fatal(err)
	}
	return testWitness{s, v}
}

// cosign has the witnesses cosign the bundle's checkpoint, as a witness
// does (its signature line after the host's).
func cosign(t *testing.T, fs tarFiles, hostKey string, ws ...testWitness) tarFiles {
	t.Helper()
	cp, _ := fs.get(bundleCheckpoint)
	host, err := note.NewVerifier(hostKey)
	if err != nil {
		t.Fatal(err)
	}
	n, err := note.Open(cp, note.VerifierList(host))
	if err != nil {
		t.Fatal(err)
	}
	var signers []note.Signer
	for _, w := range ws {
		signers = append(signers, w.signer)
	}
	msg, err := note.Sign(n, signers...)
	if err != nil {
		t.Fatal(err)
	}
	return fs.set(bundleCheckpoint, msg)
}

func verifyWitnessed(t *testing.T, b []byte, key string, quorum int, ws ...testWitness) *BundleReport {
	t.Helper()
	opts := BundleVerifyOptions{Key: key, Quorum: quorum}
	for _, w := range ws {
		opts.Witnesses = append(opts.Witnesses, w.verifier)
	}
	rep, err := VerifyBundle(bytes.NewReader(b), opts)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestBundleWitnessed: with --witness, a bundle's checkpoint must carry a
// quorum of the witnesses' valid cosignatures, and every one of theirs on
// it must be of this checkpoint; a failure names the checkpoint and the
// witnesses missing.
func TestBundleWitnessed(t *testing.T) {
	s := newSampleLog(t)
	b, m := exportSample(t, s)
	key := logKey(t, s.dir)
	w1, w2, w3 := newTestWitness(t, "w1.example"), newTestWitness(t, "w2.example"), newTestWitness(t, "w3.example")
	cosigned := cosign(t, untar(t, b), key, w1, w2).tar(t)
	where := "checkpoint at " + itoa(m.TreeSize) + " records (root "

	t.Run("quorum met", func(t *testing.T) {
		rep := verifyWitnessed(t, cosigned, key, 2, w1, w2, w3)
		if !rep.OK() || !slices.Equal(rep.Cosigned, []string{"w1.example", "w2.example"}) {
			t.Errorf("report %+v, want ok, cosigned by w1 and w2", rep)
		}
		// The default quorum is 1.
		if rep := verifyWitnessed(t, cosigned, key, 0, w3, w2); !rep.OK() {
			t.Errorf("quorum 1 of w3, w2: %v", rep.Problems)
		}
		// Without the log's key, the bundle's own key.pub is the host's.
		if rep := verifyWitnessed(t, cosigned, "", 1, w1); !rep.OK() || !rep.KeyFromBundle {
			t.Errorf("with the bundle's key: %+v", rep)
		}
	})
	t.Run("quorum not met", func(t *testing.T) {
		rep := verifyWitnessed(t, cosigned, key, 3, w1, w3, w2)
		expect(t, rep, problemWant{audit.ProblemUnwitnessed, -1, "has 2 valid cosignatures of the 3 needed; missing: witness w3.example:"})
		if !strings.Contains(rep.Problems[0].Detail, where) || rep.Problems[0].Checkpoint == nil || *rep.Problems[0].Checkpoint != m.TreeSize {
			t.Errorf("the problem %+v does not name the checkpoint", rep.Problems[0])
		}
	})
	t.Run("no cosignatures", func(t *testing.T) {
		rep := verifyWitnessed(t, b, key, 0, w1, w2)
		expect(t, rep, problemWant{audit.ProblemUnwitnessed, -1, "has 0 valid cosignatures of the 1 needed; missing: witness w1.example, witness w2.example:"})
		if len(rep.Cosigned) != 0 {
			t.Errorf("cosigned by %v", rep.Cosigned)
		}
	})
	t.Run("a cosignature of another checkpoint", func(t *testing.T) {
		// w2 cosigned another checkpoint of the log (here: one tree size
		// more); its signature line is put on this one.
		fs := untar(t, b)
		cp, _ := fs.get(bundleCheckpoint)
		host, _ := note.NewVerifier(key)
		n, err := note.Open(cp, note.VerifierList(host))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.SplitN(n.Text, "\n", 3)
		other := lines[0] + "\n" + itoa(m.TreeSize+1) + "\n" + lines[2]
		otherMsg, err := note.Sign(&note.Note{Text: other}, w2.signer)
		if err != nil {
			t.Fatal(err)
		}
		on, err := note.Open(otherMsg, note.VerifierList(w2.verifier))
		if err != nil {
			t.Fatal(err)
		}
		n.Sigs = append(n.Sigs, on.Sigs...)
		msg, err := note.Sign(n, w1.signer)
		if err != nil {
			t.Fatal(err)
		}
		forged := fs.set(bundleCheckpoint, msg).tar(t)
		// w1's is valid, enough for a quorum of 1: w2's is still refused.
		rep := verifyWitnessed(t, forged, key, 1, w1, w2)
		expect(t, rep, problemWant{audit.ProblemCosignature, -1, "the cosignature of witness w2.example does not match: the witness cosigned another checkpoint"})
		if !slices.Equal(rep.Cosigned, []string{"w1.example"}) {
			t.Errorf("cosigned by %v, want w1 alone", rep.Cosigned)
		}
		rep = verifyWitnessed(t, forged, key, 2, w1, w2)
		expect(t, rep,
			problemWant{audit.ProblemCosignature, -1, "witness w2.example does not match"},
			problemWant{audit.ProblemUnwitnessed, -1, "has 1 valid cosignatures of the 2 needed; missing: witness w2.example:"})
	})
	t.Run("a checkpoint that does not verify", func(t *testing.T) {
		fs := untar(t, cosigned)
		cp, _ := fs.get(bundleCheckpoint)
		forged := fs.set(bundleCheckpoint, bytes.Replace(cp, []byte("\n"+itoa(m.TreeSize)+"\n"), []byte("\n"+itoa(m.TreeSize+1)+"\n"), 1)).tar(t)
		rep := verifyWitnessed(t, forged, key, 1, w1)
		if !hasProblem(rep, audit.ProblemUnwitnessed, "its cosignatures were not checked") || !hasProblem(rep, audit.ProblemCheckpointSignature, "") {
			t.Errorf("problems %v, want the signature refused and the cosignatures not counted", rep.Problems)
		}
	})
}
