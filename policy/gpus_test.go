package policy

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/gpu"
)

func TestAPIInputGPUs(t *testing.T) {
	in, err := DecodeInput(KindAPI, []byte(`{"version":1,"caller":{"type":"peer","uid":0,"gid":0,"pid":1},"daemon_uid":0,
		"procedure":"/carrel.api.v1.VMService/CreateVM","vm":"train","gpus":["0000:61:00.0","0000:4A:00.0","00000:61:00.0"]}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"0000:4a:00.0", "0000:61:00.0"} // canonical, sorted, once each
	if got := in.(*APIInput).GPUs; !reflect.DeepEqual(got, want) {
		t.Errorf("gpus %v, want %v", got, want)
	}
	// The canonical JSON names them, and decodes to itself.
	canon, _ := canonical(in)
	if !strings.Contains(string(canon), `"gpus":["0000:4a:00.0","0000:61:00.0"]`) {
		t.Errorf("canonical input: %s", canon)
	}
	again, err := DecodeInput(KindAPI, canon)
	if err != nil || Digest(again) != Digest(in) {
		t.Errorf("canonical form does not decode to itself: %v", err)
	}
	// No GPUs: no "gpus" key at all, so every other input keeps its digest.
	none := &APIInput{Caller: peer(0), Procedure: "/carrel.api.v1.VMService/ListVMs", GPUs: []string{}}
	if err := none.Normalize(); err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(none); strings.Contains(string(b), "gpus") {
		t.Errorf("an input without gpus: %s", b)
	}

	for _, bad := range [][]string{{"41:00.0"}, {"0000:41:00.0 "}, {"0000:41:20.0"}, {""}, make([]string, MaxGPUs+1)} {
		in := &APIInput{Caller: peer(0), Procedure: "/a", GPUs: bad}
		if err := in.Normalize(); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("gpus %q: Normalize = %v, want ErrInvalidInput", bad, err)
		}
	}
}

// The policy and carreld's GPU code must agree on what an address is and
// how it is spelled: the policy decides on the one, carreld acts on the
// other.
func TestGPUAddressesAgreeWithSupervisor(t *testing.T) {
	for _, s := range []string{"0000:41:00.0", "0000:4A:1F.7", "10000:e1:00.0", "00000:01:00.1", "ffffffff:ff:1f.7",
		"41:00.0", "0000:41:20.0", "0000:41:00.8", "000:41:00.0", "0000:+1:00.0", "0x00:41:00.0", "123456789:00:00.0", "", "::.", "0000:41:00.0\x00"} {
		c, ok := canonicalPCI(s)
		a, err := gpu.ParseAddress(s)
		if ok != (err == nil) || (ok && c != a.String()) {
			t.Errorf("%q: policy %q %v, supervisor/gpu %v %v", s, c, ok, a, err)
		}
	}
}

// The default policy gives no VM a GPU; settings.gpu.allowed_vms does.
func TestDefaultPolicyGPUs(t *testing.T) {
	p := compiledDefault(t)
	ctx := context.Background()
	in := &APIInput{Caller: peer(0), Procedure: "/carrel.api.v1.VMService/CreateVM", VM: "train", GPUs: []string{"0000:41:00.0"}}
	d, err := p.Decide(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	if d.Allow || d.Rule != "carrel.api.gpu_vm" {
		t.Errorf("create with a GPU under the default policy: %+v", d)
	}
	in.GPUs = nil
	if d, err := p.Decide(ctx, in); err != nil || !d.Allow {
		t.Errorf("create without a GPU: %+v, %v", d, err)
	}
}
