package mcpserver

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
)

// explain is carreld's error as the agent reads it: its words (a denial
// names the policy and the rule), and what kind of error it is.
func explain(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Errorf("%s (%s)", ce.Message(), ce.Code())
	}
	return err
}

func base64Of(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

func unbase64(s string) ([]byte, error) { return base64.StdEncoding.DecodeString(s) }

// lower is an enum's name without its prefix, in lower case.
func lower(name, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(name, prefix))
}
