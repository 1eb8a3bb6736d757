package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
)

// A host's carreld is reached over ssh, as docker and podman reach a
// remote engine: ssh runs `carrel system dial-stdio` there, which joins
// its stdin and stdout to that host's API socket. The caller is then the
// ssh user on that host, decided by its policy as any local user is, and
// no carreld listens on the network.

// sshTarget parses --host: ssh://[user@]host[:port], or a bare ssh
// destination (a host, user@host, or an alias from ssh_config).
func sshTarget(host string) (dest, port string, err error) {
	if !strings.Contains(host, "://") {
		if host == "" || strings.HasPrefix(host, "-") || strings.ContainsAny(host, " \t\n/") {
			return "", "", fmt.Errorf("--host %q: want ssh://[user@]host[:port] or an ssh destination", host)
		}
		return host, "", nil
	}
	u, err := url.Parse(host)
	if err != nil {
		return "", "", fmt.Errorf("--host: %w", err)
	}
	if u.Scheme != "ssh" || u.Hostname() == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
		return "", "", fmt.Errorf("--host %q: want ssh://[user@]host[:port]", host)
	}
	dest = u.Hostname()
	if u.User != nil {
		dest = u.User.Username() + "@" + dest
	}
	if strings.HasPrefix(dest, "-") {
		return "", "", fmt.Errorf("--host %q: a destination may not start with '-'", host)
	}
	return dest, u.Port(), nil
}

// sshDialer returns a dialer that runs ssh to host for each connection.
func sshDialer(host, remoteSocket string) (func(context.Context) (net.Conn, error), error) {
	dest, port, err := sshTarget(host)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) (net.Conn, error) {
		args := []string{"-T"}
		if port != "" {
			args = append(args, "-p", port)
		}
		args = append(args, "--", dest, "carrel", "system", "dial-stdio")
		if remoteSocket != "" {
			args = append(args, "--socket", remoteSocket)
		}
		cmd := exec.Command(sshCommand(), args...)
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("ssh to %s: %w", dest, err)
		}
		return &cmdConn{cmd: cmd, in: in, out: out, dest: dest}, nil
	}, nil
}

// sshCommand is ssh, or $CARREL_SSH.
func sshCommand() string {
	if s := os.Getenv("CARREL_SSH"); s != "" {
		return s
	}
	return "ssh"
}

// cmdConn is a connection over a command's stdin and stdout.
type cmdConn struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   io.ReadCloser
	dest  string
	close sync.Once
}

func (c *cmdConn) Read(p []byte) (int, error)  { return c.out.Read(p) }
func (c *cmdConn) Write(p []byte) (int, error) { return c.in.Write(p) }

func (c *cmdConn) Close() error {
	c.close.Do(func() {
		c.in.Close()
		done := make(chan struct{})
		go func() { c.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
			c.cmd.Process.Kill()
			<-done
		}
	})
	return nil
}

func (c *cmdConn) LocalAddr() net.Addr                { return sshAddr("local") }
func (c *cmdConn) RemoteAddr() net.Addr               { return sshAddr(c.dest) }
func (c *cmdConn) SetDeadline(t time.Time) error      { return nil }
func (c *cmdConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *cmdConn) SetWriteDeadline(t time.Time) error { return nil }

type sshAddr string

func (sshAddr) Network() string  { return "ssh" }
func (a sshAddr) String() string { return string(a) }

// newSystemCmd holds what a remote carrel runs.
func newSystemCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "system", Short: "Plumbing for remote use", Hidden: true}
	cmd.AddCommand(&cobra.Command{
		Use:   "dial-stdio",
		Short: "Join stdin and stdout to carreld's API socket (what carrel --host runs over ssh)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := net.Dial("unix", g.socket)
			if err != nil {
				return fmt.Errorf("cannot reach carreld at %s: %w", g.socket, err)
			}
			defer c.Close()
			done := make(chan error, 2)
			go func() {
				_, err := io.Copy(c, os.Stdin)
				c.(*net.UnixConn).CloseWrite()
				done <- err
			}()
			go func() {
				_, err := io.Copy(os.Stdout, c)
				done <- err
			}()
			err = <-done
			if errors.Is(err, net.ErrClosed) {
				err = nil
			}
			return err
		},
	})
	return cmd
}
