package main

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/redis/go-redis/v9"
)

// defaultRedisURL is used when neither --redis nor REDIS_URL is set.
const defaultRedisURL = "redis://127.0.0.1:6379/0"

// redisClient connects to the Redis named by a URL: redis://, rediss://
// (TLS) or unix://, with an optional user:password and database, as
// redis.ParseURL reads them. It also returns the URL with the password
// replaced by "xxxxx", for logs. Errors never contain the password.
func redisClient(raw string) (*redis.Client, string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		// url.Parse's errors quote parts of the URL, which may hold the
		// password when the URL is malformed: none of it is repeated.
		return nil, redactRaw(raw), fmt.Errorf("redis URL %s does not parse; use redis://[user:password@]host:port[/db] and percent-encode special characters in the password", redactRaw(raw))
	}
	redacted := u.Redacted()
	opts, err := redis.ParseURL(raw)
	if err != nil {
		msg := err.Error()
		if p, ok := u.User.Password(); ok {
			msg = scrub(msg, p)
		}
		return nil, redacted, fmt.Errorf("redis URL %s: %s; use redis://[user:password@]host:port[/db], rediss://… for TLS, or unix:///path", redacted, msg)
	}
	return redis.NewClient(opts), redacted, nil
}

// redactRaw hides the user information of a URL that does not parse.
func redactRaw(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		if strings.Contains(raw, "@") {
			return "xxxxx@" + raw[strings.LastIndex(raw, "@")+1:]
		}
		return raw
	}
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		return scheme + "://xxxxx@" + rest[at+1:]
	}
	return raw
}

// scrub removes secret from msg.
func scrub(msg, secret string) string {
	if secret == "" {
		return msg
	}
	return strings.ReplaceAll(msg, secret, "xxxxx")
}
