// Package cluster starts a real Kubernetes control plane for the fleet
// tests: etcd, kube-apiserver, kube-scheduler and kube-controller-manager,
// built from the Go module proxy by `make fleet-tools`, all on 127.0.0.1
// with free ports, a CA and serving certificate made here, static tokens,
// and authorization by Node and RBAC with NodeRestriction admission: the
// hosts are held to their own Nodes as in a production cluster.
package cluster

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"

	"github.com/carrel-os/carrel/tests/harness"
)

// ToolsEnv names the directory of the control plane's binaries.
const ToolsEnv = "CARREL_FLEET_TOOLS"

// Cluster is a running control plane.
type Cluster struct {
	t      harness.TB
	Dir    string
	URL    string
	tokens map[string]string // user -> token
	Admin  *rest.Config
	procs  []*Proc
}

// Proc is one process of the control plane, or of the test, logging to
// a file in the cluster's directory.
type Proc struct {
	Name   string
	ended  bool // by Stop or Kill
	Cmd    *exec.Cmd
	Log    string
	exited chan struct{}
}

// Bin returns the control plane's binary directory, skipping the test
// with how to build it when it is missing (failing when CARREL_REQUIRE_VM
// says the suite must run in full).
func Bin(t harness.TB) string {
	dir := os.Getenv(ToolsEnv)
	missing := dir == ""
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			missing = true
		}
	}
	if missing {
		why := fmt.Sprintf("no Kubernetes control plane in %s=%q: run make fleet-tools (its first build takes about 7 minutes), or make integration", ToolsEnv, dir)
		if os.Getenv("CARREL_REQUIRE_VM") != "" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	return dir
}

// Users are the identities the tests use, each with groups.
type User struct {
	Name   string
	Groups []string
}

// Start starts the control plane. users get static tokens, beside the
// admin, the scheduler and the controller manager.
func Start(t harness.TB, users ...User) *Cluster {
	bin := Bin(t)
	dir, err := os.MkdirTemp("/tmp", "cfleet-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{t: t, Dir: dir, tokens: map[string]string{}}
	t.Cleanup(func() {
		c.stopAll()
		if t.Failed() {
			for _, p := range c.procs {
				t.Logf("--- last lines of %s:\n%s", p.Name, tail(p.Log, 30))
			}
		}
		if os.Getenv("KEEP") == "" {
			os.RemoveAll(dir)
		} else {
			t.Logf("kept %s", dir)
		}
	})
	if err := c.certs(); err != nil {
		t.Fatal(err)
	}
	all := append([]User{
		{Name: "carrel-test-admin", Groups: []string{"system:masters"}},
		{Name: "system:kube-scheduler"},
		{Name: "system:kube-controller-manager"},
	}, users...)
	var tokens bytes.Buffer
	for _, u := range all {
		b := make([]byte, 16)
		rand.Read(b)
		tok := hex.EncodeToString(b)
		c.tokens[u.Name] = tok
		fmt.Fprintf(&tokens, "%s,%s,uid-%s", tok, u.Name, strings.ReplaceAll(u.Name, ":", "-"))
		if len(u.Groups) > 0 {
			fmt.Fprintf(&tokens, ",\"%s\"", strings.Join(u.Groups, ","))
		}
		tokens.WriteString("\n")
	}
	c.write("tokens.csv", tokens.Bytes())

	etcdPort, peerPort, apiPort := freePort(t), freePort(t), freePort(t)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	c.Run("etcd", filepath.Join(bin, "etcd"), "--name", "fleet", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "fleet="+peerURL, "--quota-backend-bytes", strconv.Itoa(4<<30))
	c.waitHTTP("etcd", etcdURL+"/health", nil, 30*time.Second)

	c.URL = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	p := func(n string) string { return filepath.Join(dir, n) }
	c.Run("kube-apiserver", filepath.Join(bin, "kube-apiserver"), "--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", strconv.Itoa(apiPort),
		"--tls-cert-file", p("serving.crt"), "--tls-private-key-file", p("serving.key"),
		"--client-ca-file", p("ca.crt"), "--token-auth-file", p("tokens.csv"),
		"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
		"--service-account-issuer", "https://kubernetes.default.svc", "--service-account-key-file", p("sa.pub"),
		"--service-account-signing-key-file", p("sa.key"), "--service-cluster-ip-range", "10.96.0.0/16",
		// The endpoint reconciler refuses a loopback advertise address;
		// nothing here needs the kubernetes Service's endpoints.
		"--endpoint-reconciler-type", "none",
		// No request limits: one client here may be 1,000 simulated nodes.
		"--max-requests-inflight", "0", "--max-mutating-requests-inflight", "0", "--enable-priority-and-fairness=false")
	c.Admin = c.Config("carrel-test-admin")
	c.waitHTTP("kube-apiserver", c.URL+"/readyz", c.Admin, 120*time.Second)

	serving := []string{"--tls-cert-file", p("serving.crt"), "--tls-private-key-file", p("serving.key"), "--bind-address", "127.0.0.1"}
	sched := c.Kubeconfig("system:kube-scheduler")
	c.Run("kube-scheduler", append([]string{filepath.Join(bin, "kube-scheduler"), "--kubeconfig", sched,
		"--authentication-kubeconfig", sched, "--authorization-kubeconfig", sched, "--secure-port", strconv.Itoa(freePort(t)),
		"--kube-api-qps", "5000", "--kube-api-burst", "10000"}, serving...)...)
	kcm := c.Kubeconfig("system:kube-controller-manager")
	c.Run("kube-controller-manager", append([]string{filepath.Join(bin, "kube-controller-manager"), "--kubeconfig", kcm,
		"--authentication-kubeconfig", kcm, "--authorization-kubeconfig", kcm, "--secure-port", strconv.Itoa(freePort(t)),
		"--use-service-account-credentials", "--service-account-private-key-file", p("sa.key"), "--root-ca-file", p("ca.crt"),
		"--cluster-signing-cert-file", p("ca.crt"), "--cluster-signing-key-file", p("ca.key"),
		// kube-controller-manager's own loss detection, slower than the
		// carrel controller's in these tests, as in production.
		"--node-monitor-grace-period", "40s", "--kube-api-qps", "5000", "--kube-api-burst", "10000"}, serving...)...)
	c.WaitFor("the default ServiceAccount", 90*time.Second, func() (bool, error) {
		_, err := c.Clientset(c.Admin).CoreV1().ServiceAccounts("default").Get(context.Background(), "default", metav1.GetOptions{})
		return err == nil, nil
	})
	return c
}

// Run starts a process that lives as long as the cluster.
func (c *Cluster) Run(name string, argv ...string) *Proc {
	c.t.Helper()
	logPath := filepath.Join(c.Dir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	p := &Proc{Name: name, Cmd: cmd, Log: logPath, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(p.exited) }()
	c.procs = append(c.procs, p)
	return p
}

// Proc is the last process started under name, or nil.
func (c *Cluster) Proc(name string) *Proc {
	for i := len(c.procs) - 1; i >= 0; i-- {
		if c.procs[i].Name == name {
			return c.procs[i]
		}
	}
	return nil
}

// Stop ends p with SIGTERM, then SIGKILL after 20 s.
func (p *Proc) Stop() {
	select {
	case <-p.exited:
		return
	default:
	}
	p.ended = true
	p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		p.Cmd.Process.Kill()
		<-p.exited
	}
}

// Kill ends p with SIGKILL, as a crash would.
func (p *Proc) Kill() {
	p.ended = true
	p.Cmd.Process.Kill()
	<-p.exited
}

// Exited reports whether p has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.exited:
		return true
	default:
		return false
	}
}

func (c *Cluster) stopAll() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].Stop()
	}
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Config is a client config for user.
func (c *Cluster) Config(user string) *rest.Config {
	tok, ok := c.tokens[user]
	if !ok {
		c.t.Fatalf("no token for %s", user)
	}
	return &rest.Config{Host: c.URL, BearerToken: tok, QPS: 200, Burst: 400,
		TLSClientConfig: rest.TLSClientConfig{CAFile: filepath.Join(c.Dir, "ca.crt")}}
}

// Kubeconfig writes a kubeconfig file for user and returns its path.
func (c *Cluster) Kubeconfig(user string) string {
	tok, ok := c.tokens[user]
	if !ok {
		c.t.Fatalf("no token for %s", user)
	}
	name := strings.NewReplacer(":", "-", "/", "-").Replace(user) + ".kubeconfig"
	c.write(name, fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- name: fleet
  cluster: {server: %q, certificate-authority: %q}
users:
- name: %q
  user: {token: %q}
contexts:
- name: fleet
  context: {cluster: fleet, user: %q}
current-context: fleet
`, c.URL, filepath.Join(c.Dir, "ca.crt"), user, tok, user))
	return filepath.Join(c.Dir, name)
}

// Clientset is a typed client.
func (c *Cluster) Clientset(cfg *rest.Config) *kubernetes.Clientset {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	return cs
}

// Dynamic is a dynamic client.
func (c *Cluster) Dynamic(cfg *rest.Config) *dynamic.DynamicClient {
	d, err := dynamic.NewForConfig(cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	return d
}

// Apply creates every object of a YAML stream as the admin (updating
// one that exists), waiting for CRDs to be established before objects
// after them.
func (c *Cluster) Apply(yaml []byte) {
	c.t.Helper()
	ctx := context.Background()
	dyn := c.Dynamic(c.Admin)
	disc, err := discovery.NewDiscoveryClientForConfig(c.Admin)
	if err != nil {
		c.t.Fatal(err)
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(yaml), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return
			}
			c.t.Fatal(err)
		}
		if len(u.Object) == 0 {
			continue
		}
		gvk := u.GroupVersionKind()
		var m *meta.RESTMapping
		c.WaitFor("the API of "+gvk.String(), 30*time.Second, func() (bool, error) {
			m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				mapper.Reset()
				return false, nil
			}
			return true, nil
		})
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = dyn.Resource(m.Resource).Namespace(u.GetNamespace())
		}
		if _, err := ri.Create(ctx, &u, metav1.CreateOptions{}); err != nil {
			if !apierrors.IsAlreadyExists(err) {
				c.t.Fatalf("create %s %s: %v", gvk.Kind, u.GetName(), err)
			}
			cur, err := ri.Get(ctx, u.GetName(), metav1.GetOptions{})
			if err != nil {
				c.t.Fatal(err)
			}
			u.SetResourceVersion(cur.GetResourceVersion())
			if _, err := ri.Update(ctx, &u, metav1.UpdateOptions{}); err != nil {
				c.t.Fatalf("update %s %s: %v", gvk.Kind, u.GetName(), err)
			}
		}
		if gvk.Kind == "CustomResourceDefinition" {
			crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
			c.WaitFor("CRD "+u.GetName()+" established", 30*time.Second, func() (bool, error) {
				cur, err := dyn.Resource(crds).Get(ctx, u.GetName(), metav1.GetOptions{})
				if err != nil {
					return false, nil
				}
				conds, _, _ := unstructured.NestedSlice(cur.Object, "status", "conditions")
				for _, cd := range conds {
					m, _ := cd.(map[string]any)
					if m["type"] == "Established" && m["status"] == "True" {
						return true, nil
					}
				}
				return false, nil
			})
			mapper.Reset()
		}
	}
}

// WaitFor polls cond every 200 ms until it holds, failing the test after
// limit or on cond's error, or when a process of the cluster has exited.
func (c *Cluster) WaitFor(what string, limit time.Duration, cond func() (bool, error)) {
	c.WaitForIn(c.t, what, limit, cond)
}

// WaitForIn is WaitFor failing t, a subtest.
func (c *Cluster) WaitForIn(t harness.TB, what string, limit time.Duration, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		ok, err := cond()
		if err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		if ok {
			return
		}
		for _, p := range c.procs {
			if !p.ended && p.Exited() {
				t.Fatalf("%s exited while waiting for %s:\n%s", p.Name, what, tail(p.Log, 30))
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s", what, limit)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (c *Cluster) waitHTTP(what, url string, cfg *rest.Config, limit time.Duration) {
	c.t.Helper()
	hc := http.DefaultClient
	if cfg != nil {
		var err error
		if hc, err = rest.HTTPClientFor(cfg); err != nil {
			c.t.Fatal(err)
		}
	}
	c.WaitFor(what+" ready", limit, func() (bool, error) {
		resp, err := hc.Get(url)
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == 200, nil
	})
}

func (c *Cluster) write(name string, b []byte) {
	if err := os.WriteFile(filepath.Join(c.Dir, name), b, 0o600); err != nil {
		c.t.Fatal(err)
	}
}

// certs makes a CA, one serving certificate for 127.0.0.1 and localhost,
// and the service-account signing key.
func (c *Cluster) certs() error {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now()
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "carrel-fleet-test-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	srv := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(48 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, caCert, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	sa, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	saPub, _ := x509.MarshalPKIXPublicKey(&sa.PublicKey)
	pemOf := func(typ string, b []byte) []byte { return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}) }
	caKeyDER, _ := x509.MarshalECPrivateKey(caKey)
	keyDER, _ := x509.MarshalECPrivateKey(key)
	c.write("ca.crt", pemOf("CERTIFICATE", caDER))
	c.write("ca.key", pemOf("EC PRIVATE KEY", caKeyDER))
	c.write("serving.crt", pemOf("CERTIFICATE", srvDER))
	c.write("serving.key", pemOf("EC PRIVATE KEY", keyDER))
	c.write("sa.key", pemOf("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(sa)))
	c.write("sa.pub", pemOf("PUBLIC KEY", saPub))
	return nil
}

var portMu sync.Mutex
var portsTaken = map[int]bool{}

// freePort picks a loopback port nothing listens on.
func freePort(t harness.TB) int {
	portMu.Lock()
	defer portMu.Unlock()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if !portsTaken[p] {
			portsTaken[p] = true
			return p
		}
	}
}
