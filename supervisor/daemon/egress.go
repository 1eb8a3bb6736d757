package daemon

import (
	"log/slog"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/egress"
	"github.com/carrel-os/carrel/supervisor/policystore"
)

var _ egress.Policies = (*policystore.Store)(nil)

// newEgress makes the egress proxy every live VM's traffic goes through.
// hostsFile, when set, replaces DNS for the names VMs reach
// (--egress-hosts).
func newEgress(hostsFile string, pols *policystore.Store, rec *audit.Log, log *slog.Logger) (*egress.Proxy, error) {
	cfg := egress.Config{Policies: pols, Audit: rec, Log: log}
	if hostsFile != "" {
		h, err := egress.LoadHosts(hostsFile)
		if err != nil {
			return nil, err
		}
		cfg.Resolver = h
		log.Info("egress resolves names from a hosts file, not DNS", "file", hostsFile, "names", len(h))
	}
	return egress.New(cfg), nil
}
