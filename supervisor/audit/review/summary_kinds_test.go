package review

import (
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// TestSummaryOfLaterKinds: GPU, egress, port-forward and quota records read as
// sentences, not raw JSON, and guest text in them stays inert.
func TestSummaryOfLaterKinds(t *testing.T) {
	for _, c := range []struct {
		kind, data string
		want       []string
	}{
		{audit.KindGPUAttach, `{"gpus":["0000:41:00.0"],"driver":"qemu"}`, []string{"0000:41:00.0", "driver qemu"}},
		{audit.KindGPUDetach, `{"gpus":["0000:41:00.0"],"driver":"qemu","reason":"stopped"}`, []string{"reason: stopped"}},
		{audit.KindNetEgress, `{"host":"registry.npmjs.org","port":443,"protocol":"tcp","outcome":"allowed","ip":"104.16.0.35","rule":"carrel.net.egress_allow","bytes_up":517,"bytes_down":1048576,"pid":77}`,
			[]string{"allowed registry.npmjs.org:443/tcp", "via 104.16.0.35", "rule carrel.net.egress_allow", "pid 77"}},
		{audit.KindNetEgress, `{"host":"evil\u001b[2J.test","port":80,"protocol":"tcp","outcome":"denied","error":"x"}`, []string{"denied", "error: x"}},
		{audit.KindOutcome, `{"bytes_from_guest":2048}`, []string{"from the guest"}},
		{audit.KindAPICall, `{"procedure":"/carrel.api.v1.VMService/CreateVM","caller":{"type":"key","key_id":"0123456789abcdef","name":"alice","images":["agent"],"policy":"","vm":""},"code":"resource_exhausted","error":"key alice is at its limit","duration_ns":5,"quota":{"limit":"vms","max":3,"used":3,"asked":1}}`,
			[]string{"-> resource_exhausted", "over quota vms: 3 held, 1 asked, limit 3", "key alice"}},
	} {
		e := &Entry{Record: audit.Record{Kind: c.kind, Provenance: audit.Host, Data: []byte(c.data)}}
		got := Summary(e)
		for _, w := range c.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s %s: summary %q lacks %q", c.kind, c.data, got, w)
			}
		}
		if strings.ContainsRune(got, 0x1b) || strings.HasPrefix(got, "{") {
			t.Errorf("%s: summary %q is raw or carries an escape", c.kind, got)
		}
	}
}
