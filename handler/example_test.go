package handler_test

import (
	"fmt"

	"github.com/jobthrottle/jobthrottle/handler"
)

// A rules file's handlers section, as the worker understands it (what
// `worker --check` prints for each handler). Header values are never
// shown, only the variables they come from.
func ExampleParseConfig() {
	rules := []byte(`
rules:
  - {name: partner, tasks: ["partner:*"], subject: {payload_field: account_id}, algorithm: gcra, limit: 20, period: 1s}
handlers:
  - task: partner:sync
    http:
      url: "https://api.partner.example/v1/accounts/{account_id}/sync"
      headers: {Authorization: "Bearer ${PARTNER_TOKEN}"}
      timeout: 10s
      idempotency_header: X-Request-Id
  - task: report:render
    result_limit: 4096
    command:
      argv: ["/usr/local/bin/render", "--tenant", "{tenant}"]
      stop_grace: 30s
`)
	c, err := handler.ParseConfig("rules.yaml", rules)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, h := range c.Handlers {
		fmt.Printf("%s (line %d): %s\n", h.Task, h.Line, h.Describe())
	}

	_, err = handler.ParseConfig("rules.yaml", []byte(`
rules:
  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}
handlers:
  - task: x
    http: {url: "https://{host}/v1/items"}
`))
	fmt.Println(err)
	// Output:
	// partner:sync (line 5): http POST https://api.partner.example/v1/accounts/{account_id}/sync, timeout 10s, task ID in X-Request-Id, headers: Authorization from ${PARTNER_TOKEN}, result up to 65536 bytes
	// report:render (line 11): command ["/usr/local/bin/render" "--tenant" "{tenant}"], timeout 1m0s, SIGKILL 30s after SIGTERM, no retry on exit codes [65], result up to 4096 bytes
	// rules.yaml:6: handlers[1].http.url: "https://{host}/v1/items": the host must be written out in the file (no placeholders, no user:password@)
}
