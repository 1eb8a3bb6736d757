package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/mcpserver"
)

func newMCPCmd(g *globals) *cobra.Command {
	var vm, listen string
	cmd := &cobra.Command{
		Use:   "mcp [--vm NAME] [--listen ADDR]",
		Short: "Serve carrel's tools to an agent over MCP (stdio, or streamable HTTP)",
		Long: `mcp serves carrel's tools to an agent over the Model Context Protocol, on stdin and stdout:
exec, read_file, write_file, list_dir, stat, make_dir, remove, move, search_files, port_forward, snapshot,
restore, fork and vm_list; and, as resources, each VM's audit timeline and the end of its serial console
(carrel://vm/NAME/audit, carrel://vm/NAME/console).

Each tool is an ordinary call to carreld, made as the caller of carrel mcp (the local user, or --token's
holder): the VM's policy decides it and the audit log records it. With --vm the tools act on that VM only;
without, each call names its VM.

An agent's MCP configuration runs it as a command, e.g. {"command": "carrel", "args": ["mcp", "--vm", "dev"]}.

With --listen, it serves MCP's streamable HTTP transport at http://ADDR/mcp instead. Every request must carry
a carrel token as its bearer token (carrel token create VM), and its session acts as that token's holder, on
the token's VM alone; with --vm, only tokens for that VM are let in. Requests whose Host is not a loopback
name are refused (DNS rebinding).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if vm != "" {
				if err := client.ValidVMName(vm); err != nil {
					return err
				}
			}
			cfg := mcpserver.Config{VM: vm, Version: version}
			if listen != "" {
				return serveMCP(cmd.Context(), g, listen, cfg)
			}
			return mcpserver.New(g.client(), cfg).Run(cmd.Context(), &mcp.StdioTransport{})
		},
	}
	cmd.Flags().StringVar(&vm, "vm", "", "act on this VM only (with --listen: let in only tokens for it)")
	cmd.Flags().StringVar(&listen, "listen", "", "serve streamable HTTP on this address (e.g. 127.0.0.1:7070) instead of stdio")
	return cmd
}

// serveMCP serves MCP over HTTP on addr until ctx ends or a SIGINT or
// SIGTERM comes.
func serveMCP(ctx context.Context, g *globals, addr string, cfg mcpserver.Config) error {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	h := mcpserver.HTTP(func(token string) *client.Client { return client.New(g.socket, client.WithToken(token)) }, cfg)
	// Bearer tokens in plain HTTP, and the SDK's DNS-rebinding check only
	// on loopback: a loopback address, behind a TLS proxy for others.
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--listen %q: %w", addr, err)
	}
	if ip, err := netip.ParseAddr(host); host != "localhost" && (err != nil || !ip.IsLoopback()) {
		return fmt.Errorf("--listen %q: serve on a loopback address (127.0.0.1, ::1 or localhost), and put a TLS proxy in front for others", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/mcp", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	serves := "each token's vm"
	if cfg.VM != "" {
		serves = "vm " + cfg.VM
	}
	fmt.Fprintf(os.Stderr, "carrel mcp: serving %s on http://%s/mcp\n", serves, ln.Addr())
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
