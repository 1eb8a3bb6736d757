package e2b

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/supervisor/api"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// facade serves the e2b API over a carreld API of fake VMs, of image
// "base", and returns its URL and the tokens its keys are issued from.
func facade(t *testing.T) (string, *identity.Tokens) {
	t.Helper()
	dir := t.TempDir()
	img, _ := storetest.WithFakeImage(t, dir, DefaultTemplate)
	reg, err := registry.Open(filepath.Join(dir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pols, err := policystore.Open(ctx, filepath.Join(dir, "policies"), nil)
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := identity.OpenTokens(filepath.Join(dir, "tokens.json"))
	if err != nil {
		t.Fatal(err)
	}
	m := vm.New(vm.Config{Registry: reg, Images: img, Driver: drivertest.New(), BootTimeout: 2 * time.Second, Policies: pols})
	t.Cleanup(func() { m.Close() })
	pipe := api.NewPipe()
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() {
		done <- api.Serve(sctx, pipe, api.Handler(api.Config{Manager: m, Images: img, Policies: pols, Tokens: tokens, DaemonUID: uint32(os.Getuid())}))
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	srv := httptest.NewServer(Handler(Config{Dial: pipe.Dial, Tokens: tokens}))
	t.Cleanup(srv.Close)
	return srv.URL, tokens
}

// TestQuotaIs429: a create over the key's limit gets e2b's 429, with its
// JSON error naming the limit.
func TestQuotaIs429(t *testing.T) {
	url, tokens := facade(t)
	_, key, err := tokens.CreateKey(identity.Key{Name: "alice", Images: []string{DefaultTemplate}, Limits: identity.Limits{VMs: 1}}, 0)
	if err != nil {
		t.Fatal(err)
	}
	create := func() (int, httpError) {
		req, _ := http.NewRequest(http.MethodPost, url+"/sandboxes", strings.NewReader(`{}`))
		req.Header.Set(headerAPIKey, key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var e httpError
		if resp.StatusCode >= 400 {
			if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
				t.Fatalf("status %d, and its body is not e2b's JSON error: %v", resp.StatusCode, err)
			}
		}
		return resp.StatusCode, e
	}
	if code, e := create(); code != http.StatusCreated {
		t.Fatalf("the first sandbox: %d %+v", code, e)
	}
	code, e := create()
	if code != http.StatusTooManyRequests || e.Code != http.StatusTooManyRequests || !strings.Contains(e.Message, "--max-vms") {
		t.Errorf("a sandbox over the limit: %d %+v, want 429 naming --max-vms", code, e)
	}
}
