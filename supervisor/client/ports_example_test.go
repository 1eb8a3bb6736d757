package client_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/carrel-os/carrel/supervisor/client"
)

// An HTTP request to a server listening on port 8080 inside a VM, which
// has no network: the connection goes through carreld and the guest agent.
func ExampleClient_DialPort() {
	c := client.New(client.SocketFromEnv())
	hc := &http.Client{
		Timeout: time.Minute,
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return c.DialPort(ctx, "task-42", 8080)
			},
		},
	}
	resp, err := hc.Get("http://task-42/")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Printf("%s: %s", resp.Status, body)
}
