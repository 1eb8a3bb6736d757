// Command egressprobe runs inside a test VM, whose image has no curl, and
// reaches the network the ways a program there can. The end-to-end test
// and the benchmark build it static and copy it in.
//
//	egressprobe get URL [-ca FILE] [-sni NAME] [-out FILE]
//	    GET through HTTP_PROXY / HTTPS_PROXY (CONNECT for https); prints
//	    "status N", "bytes N", "ttfb D", "total D", then the body unless
//	    -out is given.
//	egressprobe socks HOST PORT
//	    a SOCKS5 CONNECT through ALL_PROXY (a client written here), then
//	    "GET / HTTP/1.0"; prints "reply N" and the response's status line.
//	egressprobe tunnel HOST:PORT HOSTHEADER
//	    a CONNECT to HOST:PORT through HTTP_PROXY, then a plain
//	    "GET / HTTP/1.1" with "Host: HOSTHEADER" inside the tunnel; prints
//	    "tunnel N" and the response's status line.
//	egressprobe direct HOST:PORT
//	    a plain TCP connect, no proxy; prints "connected" or the error.
//
// Errors go to stdout as "error: ..." with exit status 1.
package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fail(errors.New("usage: egressprobe get|socks|direct ..."))
	}
	var err error
	switch os.Args[1] {
	case "get":
		err = get(os.Args[2:])
	case "socks":
		err = socks(os.Args[2:])
	case "direct":
		err = direct(os.Args[2:])
	case "tunnel":
		err = tunnel(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Printf("error: %v\n", err)
	os.Exit(1)
}

func get(args []string) error {
	fs := flag.NewFlagSet("get", flag.ContinueOnError)
	ca := fs.String("ca", "", "PEM file of the CA to trust")
	sni := fs.String("sni", "", "TLS server name to send instead of the URL's host")
	out := fs.String("out", "", "write the body here instead of stdout")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("get needs one URL")
	}
	cfg := &tls.Config{ServerName: *sni}
	if *ca != "" {
		pem, err := os.ReadFile(*ca)
		if err != nil {
			return err
		}
		cfg.RootCAs = x509.NewCertPool()
		cfg.RootCAs.AppendCertsFromPEM(pem)
	}
	c := &http.Client{Transport: &http.Transport{ // no timeout: a TCG guest's clock can jump; the caller bounds the exec
		Proxy: http.ProxyFromEnvironment, TLSClientConfig: cfg, DisableKeepAlives: true, DisableCompression: true,
	}}
	start := time.Now()
	resp, err := c.Get(fs.Arg(0))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	ttfb := time.Since(start)
	var w io.Writer = os.Stdout
	if *out != "" {
		f, err := os.Create(*out)
		if err != nil {
			return err
		}
		defer f.Close()
		w = f
	}
	fmt.Printf("status %d\n", resp.StatusCode)
	var body strings.Builder
	if *out == "" {
		w = &body
	}
	n, err := io.CopyBuffer(w, resp.Body, make([]byte, 256<<10))
	total := time.Since(start)
	fmt.Printf("bytes %d\nttfb %d\ntotal %d\n", n, ttfb.Nanoseconds(), total.Nanoseconds())
	fmt.Print(body.String())
	return err
}

func socks(args []string) error {
	if len(args) != 2 {
		return errors.New("socks needs HOST PORT")
	}
	port, err := strconv.Atoi(args[1])
	if err != nil {
		return err
	}
	u, err := url.Parse(os.Getenv("ALL_PROXY"))
	if err != nil || u.Host == "" {
		return fmt.Errorf("ALL_PROXY %q is not a proxy URL", os.Getenv("ALL_PROXY"))
	}
	c, err := net.DialTimeout("tcp", u.Host, 10*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := c.Write([]byte{5, 1, 0}); err != nil {
		return err
	}
	var m [2]byte
	if _, err := io.ReadFull(c, m[:]); err != nil || m != [2]byte{5, 0} {
		return fmt.Errorf("greeting: %v %v", m, err)
	}
	req := []byte{5, 1, 0}
	if ip := net.ParseIP(args[0]); ip != nil && ip.To4() != nil {
		req = append(append(req, 1), ip.To4()...)
	} else if ip != nil {
		req = append(append(req, 4), ip.To16()...)
	} else {
		req = append(append(req, 3, byte(len(args[0]))), args[0]...)
	}
	req = append(req, byte(port>>8), byte(port))
	if _, err := c.Write(req); err != nil {
		return err
	}
	var rep [10]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		return fmt.Errorf("reply: %w", err)
	}
	fmt.Printf("reply %d\n", rep[1])
	if rep[1] != 0 {
		return nil
	}
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: %s\r\n\r\n", args[0])
	line, err := bufio.NewReader(c).ReadString('\n')
	fmt.Printf("response %s", line)
	return err
}

func tunnel(args []string) error {
	if len(args) != 2 {
		return errors.New("usage: egressprobe tunnel HOST:PORT HOSTHEADER")
	}
	proxy, err := url.Parse(os.Getenv("HTTP_PROXY"))
	if err != nil || proxy.Host == "" {
		return fmt.Errorf("HTTP_PROXY %q: %v", os.Getenv("HTTP_PROXY"), err)
	}
	c, err := net.DialTimeout("tcp", proxy.Host, 10*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", args[0], args[0])
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("CONNECT: %w", err)
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		return fmt.Errorf("CONNECT answered %q", line)
	}
	fmt.Printf("tunnel %s\n", f[1])
	for { // the rest of the proxy's answer
		l, err := br.ReadString('\n')
		if err != nil {
			return err
		}
		if strings.TrimSpace(l) == "" {
			break
		}
	}
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", args[1])
	line, err = br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("the request in the tunnel: %w", err)
	}
	fmt.Printf("response %s\n", strings.TrimSpace(line))
	rest, _ := io.ReadAll(io.LimitReader(br, 4096))
	fmt.Printf("%s\n", rest)
	return nil
}

func direct(args []string) error {
	if len(args) != 1 {
		return errors.New("direct needs HOST:PORT")
	}
	c, err := net.DialTimeout("tcp", args[0], 10*time.Second)
	if err != nil {
		return err
	}
	c.Close()
	fmt.Println("connected")
	return nil
}
