//go:build linux

package agent

import (
	"context"
	"log/slog"
	"net"

	"github.com/carrel-os/carrel/guest-agent/egress"
)

// startEgress starts the egress proxies on the guest's loopback, the VM's
// only way out (in the guest; a development host has its own network).
// They outlive a serve that fails. nil if they cannot listen.
func startEgress(ctx context.Context, log *slog.Logger, guest bool) *egress.Service {
	if !guest {
		return nil
	}
	eg := egress.New(egress.Options{Log: log})
	hl, err := net.Listen("tcp", egress.HTTPProxyAddr)
	if err != nil {
		log.Error("no egress: the HTTP proxy cannot listen", "err", err)
		return nil
	}
	sl, err := net.Listen("tcp", egress.SOCKSProxyAddr)
	if err != nil {
		hl.Close()
		log.Error("no egress: the SOCKS5 proxy cannot listen", "err", err)
		return nil
	}
	go func() { log.Error("egress HTTP proxy stopped", "err", eg.ServeHTTPProxy(ctx, hl)) }()
	go func() { log.Error("egress SOCKS5 proxy stopped", "err", eg.ServeSOCKS5(ctx, sl)) }()
	log.Info("egress proxies listening", "http", egress.HTTPProxyAddr, "socks5", egress.SOCKSProxyAddr)
	return eg
}
