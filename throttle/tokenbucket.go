package throttle

// TokenBucket: lua/bucket.lua's exact arithmetic, which it shares with
// GCRA, and lua/tokenbucket.lua.
var _ = register(TokenBucket, &algorithm{rank: 4, files: []string{"bucket.lua", "bucket_rare.lua", "tokenbucket.lua"}, bucket: true, validate: validateBurst})
