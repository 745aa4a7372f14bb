package rules_test

import (
	"fmt"
	"log"

	"github.com/jobthrottle/jobthrottle/rules"
)

func ExampleParse() {
	cfg, err := rules.Parse("rules.yaml", []byte(`
rules:
  - name: stripe
    tasks: ["stripe:*"]
    subject: {payload_field: account_id}
    algorithm: gcra
    limit: 20
    period: 1s
    max_wait: 30s
  - name: tenant-policy
    tasks: ["report:*"]
    subject: {payload_field: tenant}
    limits:
      - {name: per10s, algorithm: sliding_window, limit: 200, period: 10s}
      - {name: hourly, algorithm: fixed_window, limit: 5000, period: 1h}
`))
	if err != nil {
		log.Fatal(err)
	}
	for _, r := range cfg.Rules {
		fmt.Printf("%s %v (max wait %v):\n", r.Name, r.Tasks, r.MaxWait)
		for _, l := range r.Limits {
			fmt.Printf("   %s: %s %d per %v (burst %d)\n", l.Name, l.Algorithm, l.Limit.Count, l.Limit.Period, l.Limit.Burst)
		}
	}
	r, _ := cfg.RuleFor("stripe:charge")
	fmt.Println("stripe:charge →", r.Name)
	// Output:
	// stripe [stripe:*] (max wait 30s):
	//    stripe: gcra 20 per 1s (burst 20)
	// tenant-policy [report:*] (max wait 0s):
	//    tenant-policy.per10s: sliding_window 200 per 10s (burst 200)
	//    tenant-policy.hourly: fixed_window 5000 per 1h0m0s (burst 5000)
	// stripe:charge → stripe
}

func ExampleParse_error() {
	_, err := rules.Parse("rules.yaml", []byte(`
rules:
  - name: stripe
    tasks: ["stripe:*"]
    subject: {payload_field: account_id}
    algorithm: gcra
    limit: 20
    period: 0s
`))
	fmt.Println(err)
	// Output:
	// rules.yaml:8: rule "stripe": period: "0s" must be at least 1µs
}
