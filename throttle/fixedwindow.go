package throttle

// FixedWindow: lua/fixedwindow.lua keeps one counter per key (the latest
// window holding permits), so a backlog booked ahead costs nothing more.
var _ = register(FixedWindow, &algorithm{name: "fixed_window", files: []string{"fixedwindow.lua"}})
