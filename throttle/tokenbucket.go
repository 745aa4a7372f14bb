package throttle

// TokenBucket: lua/bucket.lua's exact arithmetic, which it shares with
// GCRA, and lua/tokenbucket.lua.
var _ = register(TokenBucket, &algorithm{name: "token_bucket", files: []string{"bucket.lua", "tokenbucket.lua"}, bucket: true, validate: validateBurst})
