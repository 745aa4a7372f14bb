// Package redisurl opens the Redis a URL names (one server, TLS, a Unix
// socket, Redis Cluster or Sentinel), checks that it answers (Ping, whose
// errors tell a refused password from silence) and writes URLs for logs
// with every password replaced. Both binaries (cmd/worker, cmd/enqueue) read their
// --redis flag with it, so they accept the same URLs.
//
// Its errors carry no package prefix: each binary prefixes its own name
// ("worker: Redis URL …"). Imports: go-redis only; it must not import any
// other package of this module.
package redisurl

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Open returns a client for the Redis that rawURL names, for both
// asynq and the limiters:
//
//	redis://[user:password@]host:port[/db][?options]      one server (rediss:// for TLS)
//	unix://[user:password@]/path/to/redis.sock[?db=N]    one server on a Unix socket
//	redis-cluster://[user:password@]host:port,host:port[?options]
//	                                                      Redis Cluster seeds (rediss-cluster:// for TLS);
//	                                                      redis://host:port,host:port means the same
//	redis-sentinel://[user:password@]host:port,host:port/master[/db][?password=…]
//	                                                      Sentinel: the sentinels' addresses and the
//	                                                      master's name (rediss-sentinel:// for TLS);
//	                                                      the userinfo authenticates to the sentinels,
//	                                                      password= (and username=) to the master
//
// Options are go-redis's query parameters (dial_timeout=3s, pool_size=20,
// …; see redis.ParseURL, redis.ParseClusterURL, redis.ParseFailoverURL).
// Errors never contain a password; log the URL with Redact.
func Open(rawURL string) (redis.UniversalClient, error) {
	if rawURL == "" {
		return nil, errors.New("empty Redis URL; use redis://host:port")
	}
	redacted := Redact(rawURL)
	fail := func(err error) error {
		// url.Error repeats the URL, password and all: keep only its cause.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		msg := scrubSecrets(err.Error(), rawURL)
		return fmt.Errorf("Redis URL %s: %s; use redis://[user:password@]host:port[/db], rediss:// for TLS, redis-cluster://host:port,host:port or redis-sentinel://host:port,host:port/master", redacted, msg)
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fail(err)
	}
	hosts := strings.Split(u.Host, ",")
	var rdb redis.UniversalClient
	switch scheme := u.Scheme; {
	case scheme == "redis-sentinel" || scheme == "rediss-sentinel":
		rdb, err = openSentinel(u, hosts)
	case scheme == "redis-cluster" || scheme == "rediss-cluster" || (scheme == "redis" || scheme == "rediss") && len(hosts) > 1:
		rdb, err = openCluster(u, hosts)
	default:
		var opts *redis.Options
		if opts, err = redis.ParseURL(rawURL); err == nil {
			rdb = redis.NewClient(opts)
		}
	}
	if err != nil {
		return nil, fail(err)
	}
	return rdb, nil
}

// openSentinel opens the Sentinel-managed master that u names
// (redis-sentinel://host:port,host:port/master[/db]; hosts are u's).
func openSentinel(u *url.URL, hosts []string) (redis.UniversalClient, error) {
	parts := strings.FieldsFunc(u.Path, func(r rune) bool { return r == '/' })
	if len(parts) == 0 || len(parts) > 2 {
		return nil, errors.New("the path must be /<master name>[/<db>]")
	}
	q := u.Query()
	q.Set("master_name", parts[0])
	for _, h := range hosts[1:] {
		q.Add("addr", h)
	}
	u.Scheme, u.Host, u.Path, u.RawQuery = strings.TrimSuffix(u.Scheme, "-sentinel"), hosts[0], "/"+strings.Join(parts[1:], "/"), q.Encode()
	opts, err := redis.ParseFailoverURL(u.String())
	if err != nil {
		return nil, err
	}
	return redis.NewFailoverClient(opts), nil
}

// openCluster opens the Redis Cluster whose seeds u names
// (redis-cluster://host:port,host:port; hosts are u's).
func openCluster(u *url.URL, hosts []string) (redis.UniversalClient, error) {
	if u.Path != "" && u.Path != "/" && u.Path != "/0" {
		return nil, errors.New("Redis Cluster has only database 0")
	}
	q := u.Query()
	for _, h := range hosts[1:] {
		q.Add("addr", h)
	}
	u.Scheme, u.Host, u.Path, u.RawQuery = strings.TrimSuffix(u.Scheme, "-cluster"), hosts[0], "", q.Encode()
	opts, err := redis.ParseClusterURL(u.String())
	if err != nil {
		return nil, err
	}
	return redis.NewClusterClient(opts), nil
}

// Ping checks that the Redis rdb, opened from rawURL, answers within ctx.
// Its error tells apart what an operator fixes differently, with the URL
// redacted and no password in it: the server refused the credentials
// ("authentication failed"), wants a password the URL does not give, or
// has none while the URL gives one; answered with another error; or did
// not answer at all.
func Ping(ctx context.Context, rdb redis.UniversalClient, rawURL string) error {
	err := rdb.Ping(ctx).Err()
	if err == nil {
		return nil
	}
	at, msg := Redact(rawURL), scrubSecrets(err.Error(), rawURL)
	var answer redis.Error
	if !errors.As(err, &answer) {
		return fmt.Errorf("Redis at %s does not answer: %s", at, msg)
	}
	switch {
	case strings.HasPrefix(msg, "NOAUTH"):
		return fmt.Errorf("Redis at %s wants a password and the URL gives none (%s); use redis://[user]:password@host:port", at, msg)
	case strings.Contains(msg, "without any password configured") || strings.Contains(msg, "no password is set"):
		return fmt.Errorf("Redis at %s has no password, but the URL gives one; remove it from the URL", at)
	case strings.HasPrefix(msg, "WRONGPASS") || strings.Contains(msg, "invalid password") || strings.Contains(msg, "invalid username-password"):
		return fmt.Errorf("Redis at %s: authentication failed (%s); check the user name and password in the URL", at, msg)
	}
	return fmt.Errorf("Redis at %s answered PING with an error: %s", at, msg)
}

// secretParams are the query parameters of a Redis URL that hold secrets.
var secretParams = []string{"password", "sentinel_password"}

// Redact returns rawURL with every password (in the userinfo, and in
// password= and sentinel_password= parameters) replaced by "xxxxx", for
// logs and errors. A URL that does not parse is shown as its scheme only.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err == nil && (u.Opaque != "" || u.Scheme == "") {
		// Not a URL at all: perhaps a password pasted in the wrong place.
		return "(a Redis URL without scheme://)"
	}
	if err != nil {
		scheme, _, ok := strings.Cut(rawURL, "://")
		if !ok || strings.ContainsAny(scheme, "@:/") {
			return "(a Redis URL that does not parse)"
		}
		return scheme + "://(does not parse)"
	}
	q := u.Query()
	changed := false
	for _, p := range secretParams {
		if q.Has(p) {
			q.Set(p, "xxxxx")
			changed = true
		}
	}
	if changed {
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// scrubSecrets removes from msg every password rawURL holds.
func scrubSecrets(msg, rawURL string) string {
	var secrets []string
	if u, err := url.Parse(rawURL); err == nil {
		if p, ok := u.User.Password(); ok {
			secrets = append(secrets, p, url.PathEscape(p), url.QueryEscape(p))
		}
		q := u.Query()
		for _, p := range secretParams {
			if v := q.Get(p); v != "" {
				secrets = append(secrets, v, url.QueryEscape(v))
			}
		}
	} else if _, rest, ok := strings.Cut(rawURL, "://"); ok {
		// Whatever could be userinfo.
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			secrets = append(secrets, rest[:at])
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				secrets = append(secrets, pw)
			}
		}
	}
	for _, s := range secrets {
		if s != "" {
			msg = strings.ReplaceAll(msg, s, "xxxxx")
		}
	}
	return msg
}
