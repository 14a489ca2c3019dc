//! Name resolution for the model endpoint: an IP literal is its own answer.
//!
//! ureq resolves the host again for every request, pooled connection or
//! not, and whenever a timeout applies (every attempt here has one, its
//! request timeout) it does so on a thread of its own — even for
//! `127.0.0.1`, where the lookup is a parse. That thread cost about as much
//! as a whole call to a local server. A host name still goes to ureq's own
//! resolver, unchanged.
//!
//! (ureq's resolver seam is in its `unversioned` module: a ureq update that
//! changes it fails to build here, never at run time.)

use std::net::{IpAddr, SocketAddr};

use ureq::config::{Config, IpFamily};
use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

/// ureq's default resolver behind an IP-literal shortcut.
#[derive(Default)]
pub(crate) struct LiteralFirst(DefaultResolver);

impl std::fmt::Debug for LiteralFirst {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LiteralFirst")
    }
}

/// The address an IP-literal URI names, if it is one (and of a wanted family).
fn literal(uri: &Uri, family: IpFamily) -> Option<SocketAddr> {
    let authority = uri.authority()?;
    let host = authority.host();
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let ip: IpAddr = host.parse().ok()?;
    let port = authority.port_u16().or(match uri.scheme_str()? {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    })?;
    let wanted = match family {
        IpFamily::Any => true,
        IpFamily::Ipv4Only => ip.is_ipv4(),
        IpFamily::Ipv6Only => ip.is_ipv6(),
    };
    wanted.then_some(SocketAddr::new(ip, port))
}

impl Resolver for LiteralFirst {
    fn resolve(
        &self,
        uri: &Uri,
        config: &Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        match literal(uri, config.ip_family()) {
            Some(addr) => {
                let mut out = self.empty();
                out.push(addr);
                Ok(out)
            }
            None => self.0.resolve(uri, config, timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(uri: &str, family: IpFamily) -> Option<SocketAddr> {
        literal(&uri.parse::<Uri>().expect("uri"), family)
    }

    #[test]
    fn literals_are_answered_and_names_are_not() {
        assert_eq!(addr("http://127.0.0.1:8080/v1", IpFamily::Any), "127.0.0.1:8080".parse().ok());
        assert_eq!(addr("https://10.0.0.2/v1", IpFamily::Any), "10.0.0.2:443".parse().ok());
        assert_eq!(addr("http://[::1]/v1", IpFamily::Any), "[::1]:80".parse().ok());
        // Not a literal, or not of the wanted family: ureq's resolver decides.
        assert_eq!(addr("https://api.example.com/v1", IpFamily::Any), None);
        assert_eq!(addr("http://[::1]/v1", IpFamily::Ipv4Only), None);
        assert_eq!(addr("http://127.0.0.1/v1", IpFamily::Ipv6Only), None);
    }
}
