package httpthrottle

import (
	"net/http"
	"testing"
	"time"
)

// ParseProviderHeaders reads the headers OpenAI and Anthropic document,
// in samples of the shapes their docs show (values of our own).
func TestParseProviderHeaders(t *testing.T) {
	now := time.Date(2026, 11, 26, 5, 0, 0, 0, time.UTC)
	for _, c := range []struct {
		name    string
		headers map[string]string
		want    ProviderLimits
		ok      bool
	}{
		{"openai", map[string]string{
			"x-ratelimit-limit-requests": "500", "x-ratelimit-remaining-requests": "499", "x-ratelimit-reset-requests": "120ms",
			"x-ratelimit-limit-tokens": "200000", "x-ratelimit-remaining-tokens": "199250", "x-ratelimit-reset-tokens": "225ms",
		}, ProviderLimits{
			Requests: ProviderLimit{500, 499, true, 120 * time.Millisecond, true},
			Tokens:   ProviderLimit{200000, 199250, true, 225 * time.Millisecond, true},
		}, true},
		{"openai, long resets and a 429", map[string]string{
			"x-ratelimit-limit-requests": "10000", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s",
			"x-ratelimit-limit-tokens": "30000", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m2.5s",
			"retry-after": "3", "retry-after-ms": "2750.5",
		}, ProviderLimits{
			Requests:   ProviderLimit{10000, 0, true, 6 * time.Minute, true},
			Tokens:     ProviderLimit{30000, 0, true, 62500 * time.Millisecond, true},
			RetryAfter: 2750500 * time.Microsecond, HasRetryAfter: true,
		}, true},
		{"openai-compatible, reset in seconds, a limit not applied", map[string]string{
			"x-ratelimit-limit-tokens": "-1", "x-ratelimit-remaining-tokens": "-1", "x-ratelimit-reset-tokens": "0",
			"x-ratelimit-limit-requests": "60", "x-ratelimit-reset-requests": "1.5",
		}, ProviderLimits{
			Requests: ProviderLimit{Limit: 60, Reset: 1500 * time.Millisecond, HasReset: true},
			Tokens:   ProviderLimit{HasReset: true},
		}, true},
		{"anthropic", map[string]string{
			"anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "49", "anthropic-ratelimit-requests-reset": "2026-11-26T05:00:01Z",
			"anthropic-ratelimit-input-tokens-limit": "30000", "anthropic-ratelimit-input-tokens-remaining": "28000", "anthropic-ratelimit-input-tokens-reset": "2026-11-26T05:00:04Z",
			"anthropic-ratelimit-output-tokens-limit": "8000", "anthropic-ratelimit-output-tokens-remaining": "8000", "anthropic-ratelimit-output-tokens-reset": "2026-11-26T05:00:00Z",
			"anthropic-ratelimit-tokens-limit": "30000", "anthropic-ratelimit-tokens-remaining": "28000", "anthropic-ratelimit-tokens-reset": "2026-11-26T05:00:04Z",
		}, ProviderLimits{
			Requests:     ProviderLimit{50, 49, true, time.Second, true},
			InputTokens:  ProviderLimit{30000, 28000, true, 4 * time.Second, true},
			OutputTokens: ProviderLimit{8000, 8000, true, 0, true},
			Tokens:       ProviderLimit{30000, 28000, true, 4 * time.Second, true},
		}, true},
		{"anthropic 429, a reset past and one with an offset", map[string]string{
			"anthropic-ratelimit-output-tokens-limit": "8000", "anthropic-ratelimit-output-tokens-remaining": "0",
			"anthropic-ratelimit-output-tokens-reset": "2026-11-26T06:00:12.5+01:00",
			"anthropic-ratelimit-requests-reset":      "2026-11-26T04:59:00Z",
			"retry-after":                             "13",
		}, ProviderLimits{
			Requests:     ProviderLimit{HasReset: true},
			OutputTokens: ProviderLimit{8000, 0, true, 12500 * time.Millisecond, true},
			RetryAfter:   13 * time.Second, HasRetryAfter: true,
		}, true},
		{"unparsable values", map[string]string{
			"x-ratelimit-limit-requests": "many", "x-ratelimit-reset-requests": "soon",
			"anthropic-ratelimit-tokens-reset": "tomorrow", "retry-after-ms": "-5",
		}, ProviderLimits{}, false},
		{"retry-after as a date", map[string]string{"retry-after": "Thu, 26 Nov 2026 05:00:30 GMT"},
			ProviderLimits{RetryAfter: 30 * time.Second, HasRetryAfter: true}, true},
		{"none", map[string]string{"content-type": "application/json"}, ProviderLimits{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range c.headers {
				h.Set(k, v)
			}
			got, ok := ParseProviderHeaders(h, now)
			if got != c.want || ok != c.ok {
				t.Errorf("got %+v, %v\nwant %+v, %v", got, ok, c.want, c.ok)
			}
		})
	}
}
