//! The router as a service: one request in, one response out.
//!
//! [`Router::handle`] routes the method and path ([`Route::of`]), checks
//! the credential the route needs, and hands the request to the proxy path
//! ([`crate::router`]) or to the router's own routes ([`crate::admin`]).
//! Living apart from both keeps the module graph one-directional: the
//! admin routes use the router, the router does not know them.

use crate::body::{BoxBody, BoxError};
use crate::extract::ApiKind;
use crate::router::{RequestTrace, Router};
use crate::routes::Route;
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;

impl Router {
    /// Handles one request. Never fails: every error is an HTTP response.
    pub async fn handle<B>(&self, request: Request<B>) -> Response<BoxBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let route = self.route_of(&request);
        #[cfg(feature = "otel")]
        if let Some(traced) = crate::otel::server_span(&self.config().trace, &request, route) {
            return self.handle_traced(request, route, traced).await;
        }
        self.handle_untraced(request, route, RequestTrace::default())
            .await
    }

    /// The route of `request`'s method and path: one of the router's, or a
    /// configured passthrough path, or [`Route::NotFound`].
    fn route_of<B>(&self, request: &Request<B>) -> Route {
        let route = Route::of(request.method(), request.uri().path());
        if route == Route::NotFound
            && crate::routes::passthrough_matches(
                &self.config().passthrough_paths,
                request.uri().path(),
            )
        {
            return Route::Proxy(ApiKind::Other);
        }
        route
    }

    /// [`handle`](Self::handle) with the request's server span: started
    /// here, handed to the request path (the parent of its other spans),
    /// and ended by the response body at its end. The request's future is
    /// not instrumented: nothing is done per poll.
    #[cfg(feature = "otel")]
    async fn handle_traced<B>(
        &self,
        request: Request<B>,
        route: Route,
        traced: crate::otel::Traced,
    ) -> Response<BoxBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt as _;
        let response = self
            .handle_untraced(request, route, Some(traced.clone()))
            .await;
        traced.record_response(response.status());
        response.map(|body| crate::otel::SpanBody::new(body, traced).boxed_unsync())
    }

    async fn handle_untraced<B>(
        &self,
        request: Request<B>,
        route: Route,
        trace: RequestTrace,
    ) -> Response<BoxBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let started = Instant::now();
        let result = match self.authorize(route, request.headers()) {
            Err(err) => Err(err),
            Ok(()) => match route {
                Route::Proxy(kind) => self.proxy(kind, request, started, trace).await,
                Route::Models => self.proxy(ApiKind::Other, request, started, trace).await,
                other => crate::admin::handle(self, other, request).await,
            },
        };
        let response = result.unwrap_or_else(|err| {
            self.metrics().record_error(&err);
            err.into_response()
        });
        self.metrics()
            .record_response(route, response.status(), started.elapsed());
        response
    }
}
