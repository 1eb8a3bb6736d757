// Package examples embeds the example policies in the directories beside
// this file: each a data.json layered on the default rules, with Rego
// tests of its own. policy/bundle serves them as built-in policies.
package examples

import "embed"

// FS holds every example, under its name.
//
//go:embed */*.rego */data.json
var FS embed.FS
