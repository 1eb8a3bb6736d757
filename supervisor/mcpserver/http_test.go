package mcpserver

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/supervisor/client"
)

// bearer adds a bearer token to each request.
type bearer string

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+string(b))
	return http.DefaultTransport.RoundTrip(r)
}

// httpSession connects an MCP client to url with token; it returns the
// connect error.
func httpSession(t *testing.T, url, token string) (*mcp.ClientSession, error) {
	t.Helper()
	s, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(context.Background(),
		&mcp.StreamableClientTransport{Endpoint: url, HTTPClient: &http.Client{Transport: bearer(token)}, MaxRetries: -1}, nil)
	if err == nil {
		t.Cleanup(func() { s.Close() })
	}
	return s, err
}

// TestHTTPScopedByToken: served over HTTP without a VM, each session is
// scoped to its token's VM: its tools, its vm_list and its resources are
// that VM's. With a VM, tokens for another are not let in.
func TestHTTPScopedByToken(t *testing.T) {
	sock, tokens := carreldAPI(t)
	newClient := func(token string) *client.Client { return client.New(sock, client.WithToken(token)) }
	anyVM := httptest.NewServer(HTTP(newClient, Config{}))
	t.Cleanup(anyVM.Close)
	onlyA := httptest.NewServer(HTTP(newClient, Config{VM: "a"}))
	t.Cleanup(onlyA.Close)
	secret := map[string]string{}
	for _, vm := range []string{"a", "b"} {
		_, s, err := tokens.Create(vm, 0)
		if err != nil {
			t.Fatal(err)
		}
		secret[vm] = s
	}
	ctx := context.Background()
	for _, vm := range []string{"a", "b"} {
		s, err := httpSession(t, anyVM.URL, secret[vm])
		if err != nil {
			t.Fatalf("%s's token: %v", vm, err)
		}
		res, err := s.CallTool(ctx, &mcp.CallToolParams{Name: "vm_list"})
		if err != nil || res.IsError {
			t.Fatalf("%s's token, vm_list: %v %v", vm, res, err)
		}
		if got := res.StructuredContent.(map[string]any)["vms"].([]any); len(got) != 1 || got[0].(map[string]any)["name"] != vm {
			t.Errorf("%s's token, vm_list: %v", vm, got)
		}
		other := map[string]string{"a": "b", "b": "a"}[vm]
		res, err = s.CallTool(ctx, &mcp.CallToolParams{Name: "stat", Arguments: map[string]any{"vm": other, "path": "/workspace"}})
		if err != nil || !res.IsError || !strings.Contains(res.Content[0].(*mcp.TextContent).Text, "acts on vm \""+vm+"\" only") {
			t.Errorf("%s's token, a call in %s: %v %v", vm, other, res, err)
		}
		list, err := s.ListResources(ctx, nil)
		if err != nil || len(list.Resources) != 2 || list.Resources[0].URI != ResourceURI(vm, "audit") {
			t.Errorf("%s's token, resources: %v %v", vm, list, err)
		}
		if text, err := read(s, ResourceURI(vm, "audit")); err != nil || !strings.Contains(text, "vm.lifecycle") {
			t.Errorf("%s's token, its timeline: %q %v", vm, text, err)
		}
	}
	if _, err := httpSession(t, onlyA.URL, secret["a"]); err != nil {
		t.Errorf("a's token, a server of a: %v", err)
	}
	for what, token := range map[string]string{
		"b's token":     secret["b"],
		"no token":      "",
		"a made-up one": "carrel_0000000000000000_00000000000000000000000000000000",
	} {
		if _, err := httpSession(t, onlyA.URL, token); err == nil || !strings.Contains(err.Error(), "Unauthorized") {
			t.Errorf("%s, a server of a: %v", what, err)
		}
	}
}
