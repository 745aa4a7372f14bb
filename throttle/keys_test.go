package throttle

import (
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestEncodeSubject(t *testing.T) {
	seen := map[string]string{}
	for _, s := range []string{
		"tenant-42", "a:b", "a%3Ab", "{x}", "x}", "}{", "a b", "a\x00b", "line\nbreak",
		"\xff\xfe", "ünïcode", "%", "%25", "host.example.com:443", strings.Repeat("z", maxSubjectLen),
	} {
		enc, err := encodeSubject(s)
		if err != nil {
			t.Fatalf("encodeSubject(%q): %v", s, err)
		}
		if strings.ContainsAny(enc, "{}:\x00\n ") {
			t.Errorf("encodeSubject(%q) = %q contains a character that could break the key", s, enc)
		}
		if prev, dup := seen[enc]; dup {
			t.Errorf("encodeSubject(%q) = encodeSubject(%q) = %q", s, prev, enc)
		}
		seen[enc] = s
	}
	if got, _ := encodeSubject("tenant-42"); got != "tenant-42" {
		t.Errorf("a plain subject changed: %q", got)
	}
	for _, bad := range []string{"", strings.Repeat("z", maxSubjectLen+1), strings.Repeat("z", 1<<20)} {
		if _, err := encodeSubject(bad); !errors.Is(err, ErrInvalidSubject) {
			t.Errorf("encodeSubject(%d bytes): %v, want ErrInvalidSubject", len(bad), err)
		}
	}
}

// All keys of one subject map to one cluster slot, whatever the subject.
func TestKeysShareOneSlot(t *testing.T) {
	for _, s := range []string{"a", "{a}", "a}b", "}{", "x{y}z"} {
		enc, _ := encodeSubject(s)
		k1, k2 := key("p:", enc, "one"), key("p:", enc, "two")
		if hashTag(k1) != hashTag(k2) || hashTag(k1) != enc {
			t.Errorf("subject %q: keys %q and %q hash on %q and %q, want %q", s, k1, k2, hashTag(k1), hashTag(k2), enc)
		}
	}
}

// hashTag is what Redis Cluster hashes: the part between the first '{' and
// the next '}', if non-empty.
func hashTag(k string) string {
	if i := strings.IndexByte(k, '{'); i >= 0 {
		if j := strings.IndexByte(k[i+1:], '}'); j > 0 {
			return k[i+1 : i+1+j]
		}
	}
	return k
}

func newClientNoServer() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
}
