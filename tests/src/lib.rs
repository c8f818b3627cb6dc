//! kvroute test support: engine simulator and process harnesses (skeleton; see issue 3).
