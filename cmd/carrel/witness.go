package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/witness"
)

func newWitnessCmd() *cobra.Command {
	c := &cobra.Command{
		Use:   "witness",
		Short: "A witness for audit logs: cosigns each checkpoint that extends the last one it saw (C2SP tlog-witness)",
	}
	c.AddCommand(newWitnessKeygenCmd(), newWitnessServeCmd())
	return c
}

func newWitnessKeygenCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "keygen NAME FILE",
		Short: "Make a witness key: the private key goes to FILE (mode 0600), the verifier key to stdout",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := os.Stat(args[1]); err == nil {
				return fmt.Errorf("%s exists: a witness key is not replaced", args[1])
			}
			skey, vkey, err := witness.GenerateKey(args[0])
			if err != nil {
				return err
			}
			if err := atomicfile.WriteFile(args[1], []byte(skey+"\n"), 0o600); err != nil {
				return err
			}
			fmt.Println(vkey)
			return nil
		},
	}
}

func newWitnessServeCmd() *cobra.Command {
	var keyFile, state, listen string
	var logs []string
	c := &cobra.Command{
		Use:   "serve --key FILE --log KEY... --state DIR --listen ADDR",
		Short: "Serve POST /add-checkpoint for the logs whose keys --log gives (carrel audit key on each host)",
		Long: "Keeps, for each log, the latest checkpoint it cosigned in --state, and cosigns a new one\n" +
			"only if the consistency proof shows it extends that one: a log its host rewrote is refused.\n" +
			"Point carreld at it with --witness URL,KEY (KEY from carrel witness keygen).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			skey, err := os.ReadFile(keyFile)
			if err != nil {
				return err
			}
			signer, err := witness.NewSigner(string(skey))
			if err != nil {
				return err
			}
			known := map[string]note.Verifier{}
			for _, k := range logs {
				v, err := note.NewVerifier(strings.TrimSpace(k))
				if err != nil {
					return fmt.Errorf("--log %q: %w", k, err)
				}
				if _, dup := known[v.Name()]; dup {
					return fmt.Errorf("two --log keys of the origin %q: a witness tells logs apart by origin; give each host its own (carreld --audit-origin)", v.Name())
				}
				known[v.Name()] = v
			}
			if len(known) == 0 || state == "" {
				return fmt.Errorf("--log (at least one) and --state are required")
			}
			l, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
			defer stop()
			fmt.Fprintf(os.Stderr, "witness %s serving on %s\n", signer.Name(), l.Addr())
			srv := &http.Server{Handler: witness.Handler(witness.Config{Signer: signer, Logs: known, StateDir: state}),
				ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute, MaxHeaderBytes: 64 << 10}
			go func() {
				<-ctx.Done()
				sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				srv.Shutdown(sctx)
			}()
			if err := srv.Serve(l); err != http.ErrServerClosed {
				return err
			}
			return nil
		},
	}
	c.Flags().StringVar(&keyFile, "key", "", "the witness's private key (carrel witness keygen)")
	c.Flags().StringArrayVar(&logs, "log", nil, "the verifier key of a log to witness (carrel audit key); repeatable")
	c.Flags().StringVar(&state, "state", "", "directory for the latest checkpoint cosigned per log")
	c.Flags().StringVar(&listen, "listen", "127.0.0.1:7071", "address to serve on")
	return c
}
