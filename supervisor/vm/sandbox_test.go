package vm

import (
	"strings"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func TestCheckSandboxReply(t *testing.T) {
	for _, c := range []struct {
		name     string
		in       *agentv1.SetSandboxResponse
		landlock bool
		abi      int32
		detail   string
	}{
		{"fine", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: 2}, true, 2, ""},
		{"landlock with no abi", &agentv1.SetSandboxResponse{Landlock: true}, false, 0, ""},
		{"absurd abi", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: 1 << 30}, false, 0, ""},
		{"negative abi", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: -1}, false, 0, ""},
		{"escapes", &agentv1.SetSandboxResponse{Detail: "\x1b[31mred\x00\n\xff"}, false, 0, "[31mred"},
		{"huge", &agentv1.SetSandboxResponse{Detail: strings.Repeat("é", 1<<20)}, false, 0, strings.Repeat("é", maxSandboxDetail/2)},
		{"nil", nil, false, 0, ""},
	} {
		l, abi, d := checkSandboxReply(c.in)
		if l != c.landlock || abi != c.abi || d != c.detail {
			t.Errorf("%s: %v %d %q", c.name, l, abi, d)
		}
	}
}
