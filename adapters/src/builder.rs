//! What the builders of every adapter share, written once: setters that take `self` by value and
//! store a field ([`setters!`]), and a `Debug` that shows some fields ([`debug_some!`]).

/// Builder setters: each `fn name(arg: T) { field = value }` (doc comment and visibility in
/// front) becomes `fn name(mut self, arg: T) -> Self { self.field = value; self }`; several
/// `field = value` are separated by `;`. A value that reads `self` is written out by hand.
macro_rules! setters {
    ($($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),+) { $($field:ident = $value:expr);+ $(;)? })*) => {
        $(
            $(#[$attr])*
            $vis fn $name(mut self, $($arg: $ty),+) -> Self {
                $(self.$field = $value;)+
                self
            }
        )*
    };
}
pub(crate) use setters;

/// `Debug` of a struct that shows some of its fields, finished as non-exhaustive (the others are
/// connections, locks and the like): `debug_some!(f, self: "Name" { field, other = expr })`
/// shows `self.field` and, as `other`, `expr`. Its users (the outbox relay, the Redis sources)
/// need `postgres` or `redis`.
#[cfg(any(feature = "postgres", feature = "redis"))]
macro_rules! debug_some {
    ($f:expr, $this:ident: $name:literal { $($field:ident $(= $value:expr)?),+ $(,)? }) => {{
        let mut out = $f.debug_struct($name);
        $(out.field(stringify!($field), debug_some!(@value $this $field $($value)?));)+
        out.finish_non_exhaustive()
    }};
    (@value $this:ident $field:ident) => { &$this.$field };
    (@value $this:ident $field:ident $value:expr) => { &$value };
}
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) use debug_some;
